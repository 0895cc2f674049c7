"""Run by ``test_memory.py`` in a fresh interpreter: the learner's peak memory for one batch on a model with
a 50k-token vocabulary, with the memory budget and without micro-batching, and the gradients of both.

Peak = the process's resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` before
each pass) minus its resident size just before; where the reset is not allowed, a thread samples the
resident size every millisecond instead. The parent sets ``MALLOC_MMAP_THRESHOLD_`` so that every large
tensor is its own mapping, returned to the system when freed (the resident size then follows live
tensors). Prints one JSON object.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import sys
import threading

import torch

from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.train.config import GRPOConfig
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup

VOCAB = 50_000
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def high_water_mark() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def peak_above_start(fn) -> tuple[int, str]:
    """Bytes of resident memory that ``fn()`` added at its peak, and how it was measured."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    start = rss()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
    except OSError:
        samples = [start]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.001):
                samples.append(rss())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            fn()
        finally:
            done.set()
            sampler.join()
        return max(max(samples), rss()) - start, "sampled"
    fn()
    return high_water_mark() - start, "VmHWM"


def make_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def make_groups(num_groups: int, group_size: int, completion_len: int, seed: int = 0) -> list[ScoredGroup]:
    """Short prompts, long completions: logits are needed at nearly every position (the worst case)."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        comps = [
            Completion(
                token_ids=[rng.randrange(2, VOCAB) for _ in range(completion_len - rng.randrange(4))],
                logprobs=[-rng.uniform(8.0, 13.0) for _ in range(completion_len)],
                claimed_reward=0.0,
            )
            for _ in range(group_size)
        ]
        for c in comps:
            c.logprobs = c.logprobs[: len(c.token_ids)]
        group = RolloutGroup(
            task="t", prompt_id=g, prompt_token_ids=[2, 3], completions=comps, policy_version=0
        )
        out.append(ScoredGroup(group, [float(rng.random() < 0.5) for _ in comps]))
    return out


def measured_pass(learner: Learner, groups: list[ScoredGroup]) -> tuple[dict, int, str]:
    stats: dict = {}
    peak, how = peak_above_start(lambda: stats.update(learner.compute_gradients(groups, zero_grad=False)))
    return stats, peak, how


def main() -> None:
    budget_mib = float(sys.argv[1])
    torch.set_num_threads(1)
    model = make_model()
    groups = make_groups(num_groups=3, group_size=16, completion_len=30)
    common = dict(max_grad_norm=None, micro_batch_size=None)
    # warm-up: allocates .grad and loads the kernels, which are not the pass's activations
    Learner(model, GRPOConfig(**common)).compute_gradients(groups[:1])
    result: dict = {"budget_mib": budget_mib}
    grads = {}
    for name, memory in (("bounded", budget_mib), ("unbounded", None)):
        learner = Learner(model, GRPOConfig(micro_batch_memory_mb=memory, **common))
        model.zero_grad(set_to_none=False)
        stats, peak, how = measured_pass(learner, groups)
        grads[name] = [p.grad.clone() for p in model.parameters()]
        result[name] = {
            "peak_mib": peak / 2**20,
            "measured_by": how,
            "token_limit": learner.max_tokens_per_micro_batch,
            "micro_batches": stats["num_micro_batches"],
            "max_micro_batch_tokens": stats["max_micro_batch_tokens"],
            "tokens": float(
                sum(
                    len(g.group.prompt_token_ids) + len(c.token_ids)
                    for g in groups
                    for c in g.group.completions
                )
            ),
        }
    result["grad_max_abs"] = max(float(g.abs().max()) for g in grads["unbounded"])
    result["grad_max_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(grads["bounded"], grads["unbounded"], strict=True)
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
