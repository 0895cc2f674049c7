"""Benchmark of the GRPO objective when the sampler is not the trainer: quantised weights, stale versions.

Every arm is one in-process training loop on the tiny preset (no network, one torch thread): a fp32 policy
trained with ``Learner`` and AdamW exactly as a trainer peer does, fed each update by a *sampler* that is

* ``fp32``: the policy itself (the on-policy, co-located baseline);
* ``8bit`` / ``4bit``: a copy of the policy quantised with bitsandbytes (``Linear8bitLt`` / nf4
  ``Linear4bit``, as an inference peer with ``precision: 8bit|4bit`` holds it), reloaded from the policy
  after every update (staleness 0);
* ``stale-K``: a fp32 copy of the policy ``K`` updates old (every group exactly ``K`` versions stale, the
  worst case of ``max_staleness = K``);
* ``mix-K``: each group's staleness drawn uniformly from ``0..K`` (an async swarm's spread).

and trained with one of the objectives of ``echo_p2p.train.grpo``: ``ppo`` (clip against the behaviour
log-probs, the default until this benchmark), ``ppo-tis`` (the same with ``tis_cap`` 2), ``decoupled``
(decoupled PPO: clip against the trainer's own policy, behaviour mismatch as a per-token weight truncated
at 2), ``decoupled-mask`` (the weight's tokens above 2 left out, as AReaL does) and ``decoupled-off`` (no
weight: the sampler's log-probs ignored).

What counts is **reward per update of the trained fp32 policy**, not of the sampler: every ``--eval-every``
updates the policy samples ``--eval-prompts`` fixed prompts x 8 (temperature 1, fixed seed) and the mean
reward is recorded. Reported per (sampler, objective), as means over ``--seeds``: the eval reward at the
end (mean of the last 3 evaluations), the area under the eval curve (mean of all evaluations: how fast it
learns), both as ratios to the ``fp32`` sampler with the same objective and to the co-located baseline
(``fp32`` + ``ppo``), and the share of sampled tokens whose ratio to the behaviour log-prob lies outside the
clip range (how far the sampler is from the policy).

On a GPU, SmolLM2-135M (where 8-bit and 4-bit samplers put 25% and 52% of their tokens outside the clip):
``--model smollm2 --device cuda --micro-batch-size 32`` (``scripts/gpu_check.sh`` runs it).

Run: ``python benchmarks/objectives.py [--samplers fp32,8bit,4bit,stale-4,stale-8] [--objectives
ppo,decoupled] [--seeds 3] [--updates 150] [--prompts-per-step 16] [--out PATH]``; prints a table, writes
JSON (default ``benchmarks/results/objectives.json``).
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

OBJECTIVES: dict[str, dict[str, Any]] = {
    "ppo": dict(objective="ppo"),
    "ppo-tis": dict(objective="ppo", tis_cap=2.0),
    "decoupled": dict(
        objective="decoupled", proximal="current", behaviour_weight="truncate", behaviour_cap=2.0
    ),
    "decoupled-prev": dict(
        objective="decoupled", proximal="previous_version", behaviour_weight="truncate", behaviour_cap=2.0
    ),
    "decoupled-mask": dict(
        objective="decoupled", proximal="current", behaviour_weight="mask", behaviour_cap=2.0
    ),
    "decoupled-off": dict(objective="decoupled", proximal="current", behaviour_weight="off"),
}
EVAL_COMPLETIONS = 8


def parse_sampler(name: str) -> tuple[str, int]:
    """``(kind, K)``: kind in fp32 / 8bit / 4bit / stale / mix; K the staleness bound."""
    if name in ("fp32", "8bit", "4bit"):
        return name, 0
    kind, _, k = name.partition("-")
    if kind in ("stale", "mix") and k.isdigit():
        return kind, int(k)
    raise ValueError(f"unknown sampler {name!r}: fp32, 8bit, 4bit, stale-K or mix-K")


class Arm:
    """One training loop: a ``ColocatedTrainer``'s policy, learner and task, and a sampler of some kind."""

    def __init__(self, sampler: str, objective: str, seed: int, args: argparse.Namespace) -> None:
        from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer
        from echo_p2p.ml.engine import TransformersEngine
        from echo_p2p.ml.models import ModelSpec, load_policy

        self.kind, self.k = parse_sampler(sampler)
        self.args = args
        grpo = dict(micro_batch_size=args.micro_batch_size, **OBJECTIVES[objective])
        spec = ModelSpec(preset=args.model, device=args.device)
        config = ColocatedConfig(
            model=spec,
            task=args.task,
            group_size=args.group_size,
            prompts_per_step=args.prompts_per_step,
            grpo=grpo,
            optimizer={"lr": args.lr},
            steps=args.updates,
            seed=seed,
            threads=args.threads,
            name=f"{sampler}-{objective}-{seed}",
        )
        self.trainer = ColocatedTrainer(config)
        self.rng = random.Random(seed + 7919)
        self.engine = None
        if self.kind in ("8bit", "4bit"):
            model, _ = load_policy(spec.model_copy(update={"quantize": self.kind}))
            self.engine = TransformersEngine(model, self.trainer.tokenizer)
        elif self.kind in ("stale", "mix"):
            self.engine = TransformersEngine(copy.deepcopy(self.trainer.model), self.trainer.tokenizer)
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.k + 1)
        eval_rng = random.Random(10_000 + seed)
        self.eval_ids = self.trainer.task.sample_prompt_ids(eval_rng, args.eval_prompts)

    def _snapshot(self) -> dict[str, Any]:
        from echo_p2p.ml.models import full_precision_state_dict

        return full_precision_state_dict(self.trainer.model)

    def sample(self, update: int) -> list[Any]:
        t = self.trainer
        if self.kind == "fp32":
            groups, _ = t.sample_groups(update)
            return groups
        if self.kind in ("8bit", "4bit"):
            self.engine.load_weights(self._snapshot())
            groups, _ = t.sample_groups(update, engine=self.engine)
            return groups
        self.history.append(self._snapshot())  # history[-1]: this version; history[0]: K behind once warm
        ids = t.task.sample_prompt_ids(t.rng, t.config.prompts_per_step)
        if self.kind == "stale":
            stale_of = [len(self.history) - 1] * len(ids)
        else:
            stale_of = [self.rng.randint(0, len(self.history) - 1) for _ in ids]
        groups = []
        for staleness in sorted(set(stale_of)):
            chosen = [pid for pid, s in zip(ids, stale_of, strict=True) if s == staleness]
            self.engine.load_weights(self.history[-1 - staleness])
            part, _ = t.sample_groups(
                update * 64 + staleness, engine=self.engine, prompt_ids=chosen, version=update - staleness
            )
            groups.extend(part)
        return groups

    def evaluate(self, index: int) -> float:
        """Mean reward of the fp32 policy on the fixed evaluation prompts (fixed seed per evaluation)."""
        from echo_p2p.ml.tokenizer import decode_completion, encode_prompts

        t = self.trainer
        prompts = encode_prompts(
            t.tokenizer, [t.task.prompt(i) for i in self.eval_ids], t.config.model.use_chat_template
        )
        params = t.sampling.model_copy(update={"seed": 1_000_000 + index})
        samples = t.engine.sample(prompts, EVAL_COMPLETIONS, params)
        rewards = []
        for pid, group in zip(self.eval_ids, samples, strict=True):
            texts = [decode_completion(t.tokenizer, s.token_ids) for s in group]
            rewards.extend(t.task.score_batch([pid] * len(texts), texts))
        return statistics.fmean(rewards)

    def run(self) -> dict[str, Any]:
        t = self.trainer
        start = time.perf_counter()
        curve: list[tuple[int, float]] = [(0, self.evaluate(0))]
        # each stat with its value when the objective does not report it (no weight under ppo: 1)
        keys = {
            "behaviour_outside_clip_frac": 0.0,
            "clip_frac": 0.0,
            "behaviour_weight_mean": 1.0,
            "ratio_mean": 1.0,
        }
        sums: dict[str, float] = collections.defaultdict(float)
        train_rewards: list[float] = []
        for update in range(self.args.updates):
            groups = self.sample(update)
            stats = t.learner.step(groups, t.optimizer, current_version=t.version)
            t.version += 1
            train_rewards.append(stats["reward_mean"])
            for key, default in keys.items():
                sums[key] += stats.get(key, default)
            gaps = t.learner.last_group_gaps
            sums["logprob_gap"] += statistics.fmean(gaps) if gaps else 0.0
            if (update + 1) % self.args.eval_every == 0 or update + 1 == self.args.updates:
                curve.append((update + 1, self.evaluate(update + 1)))
        n = max(self.args.updates, 1)
        return {
            "curve": curve,
            "train_reward": train_rewards,
            "seconds": time.perf_counter() - start,
            **{key: sums[key] / n for key in (*keys, "logprob_gap")},
        }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_arm: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for run in runs:
        by_arm[(run["sampler"], run["objective"])].append(run)
    rows = []
    for (sampler, objective), group in by_arm.items():
        finals = [statistics.fmean(r for _, r in run["curve"][-3:]) for run in group]
        aucs = [statistics.fmean(r for _, r in run["curve"][1:]) for run in group]
        half = group[0]["curve"][len(group[0]["curve"]) // 2][0]
        at_half = [dict(run["curve"]).get(half, float("nan")) for run in group]
        rows.append(
            {
                "sampler": sampler,
                "objective": objective,
                "seeds": len(group),
                "final": statistics.fmean(finals),
                "final_min": min(finals),
                "final_max": max(finals),
                "auc": statistics.fmean(aucs),
                "half_update": half,
                "at_half": statistics.fmean(at_half),
                "outside_clip": statistics.fmean(r["behaviour_outside_clip_frac"] for r in group),
                "clip_frac": statistics.fmean(r["clip_frac"] for r in group),
                "weight_mean": statistics.fmean(r["behaviour_weight_mean"] for r in group),
                "seconds": statistics.fmean(r["seconds"] for r in group),
            }
        )
    index = {(r["sampler"], r["objective"]): r for r in rows}
    base = index.get(("fp32", "ppo"))
    for row in rows:
        same = index.get(("fp32", row["objective"]))
        for ref_name, ref in (("vs_fp32", same), ("vs_colocated", base)):
            row[f"final_{ref_name}"] = row["final"] / ref["final"] if ref and ref["final"] else None
            row[f"auc_{ref_name}"] = row["auc"] / ref["auc"] if ref and ref["auc"] else None
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def ratio(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "-"

    header = (
        f"{'sampler':<9} {'objective':<15} {'mid':>5} {'final':>6} {'(min-max)':>12} {'auc':>6} "
        f"{'fin/fp32':>8} {'auc/fp32':>8} {'fin/coloc':>9} {'auc/coloc':>9} {'off-clip':>8} {'clipped':>7}"
    )
    print(
        f"mid: eval reward at update {rows[0]['half_update'] if rows else '-'}; final: mean of the last 3 evals"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['sampler']:<9} {r['objective']:<15} {r['at_half']:>5.2f} {r['final']:>6.3f} "
            f"{r['final_min']:>5.2f}-{r['final_max']:<5.2f} {r['auc']:>7.3f} "
            f"{ratio(r['final_vs_fp32']):>8} {ratio(r['auc_vs_fp32']):>8} "
            f"{ratio(r['final_vs_colocated']):>9} {ratio(r['auc_vs_colocated']):>9} "
            f"{r['outside_clip']:>8.1%} {r['clip_frac']:>7.1%}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samplers", default="fp32,8bit,4bit,stale-4,stale-8")
    p.add_argument("--objectives", default="ppo,decoupled")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--updates", type=int, default=150)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (default: 1e-3 tiny, 1e-6 smollm2)")
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--device", default="cpu", help="torch device of the policy and the samplers")
    p.add_argument("--micro-batch-size", type=int, default=256)
    p.add_argument("--task", default="count")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results" / "objectives.json"))
    args = p.parse_args()
    if args.lr is None:
        args.lr = 1e-6 if args.model == "smollm2" else 1e-3
    samplers = args.samplers.split(",")
    objectives = args.objectives.split(",")
    for name in samplers:
        parse_sampler(name)
    unknown = [o for o in objectives if o not in OBJECTIVES]
    if unknown:
        p.error(f"unknown objectives {unknown}: {sorted(OBJECTIVES)}")

    import logging

    logging.basicConfig(level=logging.WARNING)
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for sampler in samplers:
            for objective in objectives:
                result = Arm(sampler, objective, seed, args).run()
                result.update(sampler=sampler, objective=objective, seed=seed)
                runs.append(result)
                curve = " ".join(f"{r:.2f}" for _, r in result["curve"])
                train = result["train_reward"]
                curve += f" | train last-10 {statistics.fmean(train[-10:]):.2f}"
                print(
                    f"seed {seed} {sampler:<8} {objective:<15} {result['seconds']:5.1f}s "
                    f"off-clip {result['behaviour_outside_clip_frac']:.1%} |dlogp| {result['logprob_gap']:.3f}  eval: {curve}",
                    flush=True,
                )
    rows = summarize(runs)
    print()
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},  # not this machine's path
    }
    out.write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
