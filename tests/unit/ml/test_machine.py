"""The machine check a peer makes before it joins (``echo_p2p.ml.machine``): what it asks for that this
machine cannot do is refused at once, with the fix, exit 2 (a donor's CUDA peer used to join and die ~20 s
later inside the engine with "Torch not compiled with CUDA enabled")."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from echo_p2p.ml.machine import machine_problems
from echo_p2p.ml.models import ModelSpec

NO_GPU = not torch.cuda.is_available()


def test_a_cpu_model_on_the_transformers_engine_runs_anywhere():
    assert machine_problems(ModelSpec(preset="tiny")) == []
    assert machine_problems(ModelSpec(preset="tiny", quantize="8bit")) == []  # bitsandbytes runs on CPU too


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a CUDA GPU")
def test_cuda_asked_on_a_machine_without_it_is_refused_with_the_fix():
    (problem,) = machine_problems(ModelSpec(preset="tiny", device="cuda:0"))
    assert problem.startswith("device cuda:0 asked, but ")
    if torch.version.cuda is None:
        assert f"this torch ({torch.__version__}) is a CPU build" in problem
        assert "bash scripts/setup.sh --cuda" in problem and "--device cpu" in problem
    else:
        assert "sees no CUDA GPU" in problem and "--device cpu" in problem


def test_vllm_asked_outside_its_environment_is_refused_with_the_fix(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    (problem,) = machine_problems(ModelSpec(preset="tiny"), engine="vllm")
    assert "vLLM is not installed" in problem and "scripts/setup_vllm.sh" in problem


@pytest.mark.skipif(not NO_GPU, reason="checks the refusal on a machine without a CUDA GPU")
def test_the_donors_cuda_command_exits_2_with_the_fix_before_joining(tmp_path):
    """The GPU donor's command on a machine without CUDA: refused before any network start (the initial
    peer here answers nobody: a peer that got as far as joining would fail on it instead, exit 1)."""
    from echo_p2p.guard.trust import trainer_key_line
    from echo_p2p.net.identity import load_or_create_identity

    trusted = tmp_path / "trusted.txt"
    trusted.write_text(trainer_key_line(load_or_create_identity(str(tmp_path / "t.id"))) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "echo_p2p.peer", "--role", "inference", "--run-id", "r", "--trusted-trainers",
         str(trusted), "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmRPG82YGjsLjBjksMqHTWDb9EbDwJENauRLg8kZFJmQUi",
         "--device", "cuda:0", "--identity-path", str(tmp_path / "peer.id")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: device cuda:0 asked, but" in done.stderr and "--device cpu" in done.stderr
    # nothing started: no identity made, and exit 2 rather than the unreachable initial peer's exit 1 (a wall-clock
    # bound here failed on a loaded machine and proved nothing more)
    assert not (tmp_path / "peer.id").exists()
