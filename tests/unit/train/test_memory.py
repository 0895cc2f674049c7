"""memory.py and the learner's micro-batch sizing: the token limit derived from a memory budget, and the
learner's peak memory on a 50k-token vocabulary staying within that budget with exact gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from echo_p2p.train.config import GRPOConfig
from echo_p2p.train.learner import Learner
from echo_p2p.train.memory import (
    FLOAT_BYTES,
    LOGITS_COPIES,
    MIB,
    bytes_per_token,
    fixed_bytes,
    memory_token_limit,
)

SMOLLM2 = SimpleNamespace(vocab_size=49_152, num_hidden_layers=30, hidden_size=576, intermediate_size=1536)
PROBE = Path(__file__).with_name("learner_memory_probe.py")


def test_bytes_per_token_grows_with_vocabulary_depth_and_width() -> None:
    base = bytes_per_token(SMOLLM2)
    bigger_vocab = SimpleNamespace(**{**vars(SMOLLM2), "vocab_size": 2 * 49_152})
    assert bytes_per_token(bigger_vocab) - base == LOGITS_COPIES * 49_152 * FLOAT_BYTES
    deeper = SimpleNamespace(**{**vars(SMOLLM2), "num_hidden_layers": 60})
    assert bytes_per_token(deeper) - base == base - LOGITS_COPIES * 49_152 * FLOAT_BYTES
    # a missing intermediate size counts as 4 x hidden
    no_mlp = SimpleNamespace(vocab_size=10, num_hidden_layers=1, hidden_size=8)
    assert bytes_per_token(no_mlp) == bytes_per_token(SimpleNamespace(**vars(no_mlp), intermediate_size=32))
    with pytest.raises(ValueError):
        bytes_per_token(SimpleNamespace(hidden_size=8))


def test_memory_token_limit_is_budget_minus_fixed_over_bytes_per_token() -> None:
    limit = memory_token_limit(SMOLLM2, 1024)
    assert limit == (1024 * MIB - fixed_bytes(SMOLLM2)) // bytes_per_token(SMOLLM2)
    assert 400 <= limit <= 600  # SmolLM2-135M at the default budget: ~12 rows of an arithmetic prompt
    assert memory_token_limit(SMOLLM2, 2048) > 2 * limit  # the fixed part is paid once
    assert memory_token_limit(SMOLLM2, 1) == 1  # below the fixed part: one row at a time, still trains
    with pytest.raises(ValueError):
        memory_token_limit(SMOLLM2, 0)


def test_learner_takes_the_smallest_of_memory_and_token_limits(tiny_model) -> None:
    big_vocab = SimpleNamespace(config=SimpleNamespace(**vars(SMOLLM2)))
    from_memory = memory_token_limit(SMOLLM2, 1024)
    assert Learner.token_limit(big_vocab, GRPOConfig()) == from_memory  # default budget: 1024 MiB
    assert Learner.token_limit(big_vocab, GRPOConfig(max_tokens_per_micro_batch=100)) == 100
    assert Learner.token_limit(big_vocab, GRPOConfig(max_tokens_per_micro_batch=10**6)) == from_memory
    assert Learner.token_limit(big_vocab, GRPOConfig(micro_batch_memory_mb=None)) is None
    # a plain module has no config to size by: only the explicit token limit applies
    assert Learner.token_limit(torch.nn.Linear(2, 2), GRPOConfig()) is None
    # the tiny model (16-token vocabulary, hidden 64 x 2 layers) is not held back by the default budget
    learner = Learner(tiny_model(), GRPOConfig())
    assert learner.max_tokens_per_micro_batch is not None and learner.max_tokens_per_micro_batch > 50_000


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads resident memory from /proc (Linux)")
def test_learner_peak_memory_stays_within_budget_and_gradient_is_exact() -> None:
    """A 50k-vocabulary model, 48 rows of ~31 tokens (~590 MiB of activations in one pass): with a 64 MiB
    budget the pass is split and its peak stays within the budget; the gradient equals the unsplit one."""
    budget = 64.0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(budget)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    bounded, unbounded = result["bounded"], result["unbounded"]
    assert bounded["micro_batches"] > 1 and bounded["max_micro_batch_tokens"] <= bounded["token_limit"]
    # the measurement can see the difference: one unsplit pass needs many budgets' worth
    assert unbounded["micro_batches"] == 1 and unbounded["peak_mib"] > 4 * budget, result
    # 25% headroom for what the interpreter and the allocator add around the pass
    assert bounded["peak_mib"] <= 1.25 * budget, result
    assert result["grad_max_abs"] > 1e-3  # a real gradient, not zeros
    assert result["grad_max_diff"] <= 1e-6 + 1e-4 * result["grad_max_abs"], result
