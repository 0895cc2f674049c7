"""VllmEngine against the transformers reference. Needs CUDA and vllm (an optional extra): skipped here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from echo_p2p.ml.engine import SamplingParams, completion_logprobs
from echo_p2p.ml.models import ModelSpec, build_tiny_policy, full_precision_state_dict
from echo_p2p.ml.tokenizer import encode_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="VllmEngine needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed (optional extra)"
    ),
]


def test_vllm_engine_samples_with_matching_logprobs_and_loads_new_weights():
    from echo_p2p.ml.engine_vllm import VllmEngine, VllmEngineConfig

    engine = VllmEngine(
        ModelSpec(preset="tiny", seed=0, dtype="float32"),
        VllmEngineConfig(gpu_memory_utilization=0.2, enforce_eager=True, max_model_len=256),
    )
    try:
        model, tok = build_tiny_policy(seed=0)
        prompts = encode_prompts(tok, ["3a=", "12+34=", "c>"])
        params = SamplingParams(max_new_tokens=12, seed=0, temperature=0.8)
        for version, reference in enumerate([model, build_tiny_policy(seed=1)[0]]):
            if version:
                engine.load_weights(full_precision_state_dict(reference))
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
            assert sum(diffs) / len(diffs) < 1e-2, (
                f"version {version}: vLLM log-probs differ from transformers"
            )
    finally:
        engine.close()
