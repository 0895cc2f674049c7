"""The co-located baseline: one process that alternates sampling and training, as a single-cluster system does.

This is the reference Echo's claim is measured against (arXiv 2508.05387): the same model, task and
hyper-parameters as a swarm run, but generation and GRPO updates time-share one process (verl-style), so
inference idles while the learner trains and vice versa. Every step: draw ``prompts_per_step`` prompts,
sample ``group_size`` completions of each with ``TransformersEngine`` under the current policy, score them
with the task's verifier, build ``ScoredGroup``s (policy version = step, staleness 0) and take one
``Learner.step`` with AdamW (with ``grpo.kl_beta`` > 0, ``--kl-beta``, the KL penalty to a frozen copy of
the starting policy, ``train.reference``, reported as ``kl``). Each step's figures (wall time, sampling and training seconds, reward mean and
std, rollouts consumed) go to ``<metrics_dir>/colocated-<name>.jsonl`` in the format of
``echo_p2p.metrics``, so a benchmark can put the baseline's curve and idle fractions next to the swarm's.
Between steps it scores its policy on the task's held-out prompts exactly as the publishing trainer does
(``train.evaluation``, the same ``EvalConfig`` defaults: lines with ``"event": "eval"``), so the two
compare like with like.

Owned here: ``ColocatedConfig``, ``ColocatedTrainer`` (``run()`` / ``shutdown()``) and the CLI
``python -m echo_p2p.colocated --task count --steps 300 [--metrics-dir DIR] [--duration S]``. With
``--standalone STEPS`` it is the *standalone trainer* instead: it samples STEPS steps' worth of groups once,
before the clock starts, and then only trains on them, round after round: the ceiling of what a decoupled
trainer can consume at these settings, with no network and no sampling (``benchmarks/modes.py``).
Must not touch the network. torch and transformers are imported only when a run starts, so ``--help``
and config validation stay instant.

Defaults learn ``count`` with the tiny preset: G=16 x 16 prompts, temperature 1, AdamW lr 1e-3 with betas
(0.9, 0.999), 12 new tokens at most. Measured on 1 thread (seeds 0-2, step means, 2026-12-02): reward 0.01 at
step 0, 0.07-0.09 at 50, 0.64-0.89 at 100, 0.98-0.99 over the last 20 of 300 (24-26 s); held-out greedy
accuracy (6 prompts) 0 at the start, 0.67-1.0 at the end. (With a 7-token cap it learned the letter, wrote 7
of them and never learned to stop: 0.51; see ``CountOptions.max_new_tokens``.)
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import threading
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo_p2p.cli import add_task_option_flag, install_stop_handlers
from echo_p2p.ml.engine import SamplingParams
from echo_p2p.ml.models import ModelSpec
from echo_p2p.paths import UserPath
from echo_p2p.train.config import DerivedSettings, GRPOConfig, OptimizerConfig, Precision
from echo_p2p.train.evaluation import EvalConfig

logger = logging.getLogger(__name__)


class ColocatedConfig(BaseModel):
    """One co-located run: what to train, on what, how, and for how long."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec = Field(
        default_factory=lambda: ModelSpec(preset="tiny"), description="The policy (default: tiny preset)."
    )
    task: str = Field(default="count", description="Registry name of the task (see echo_p2p.tasks).")
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the task, validated by its options model."
    )
    group_size: int = Field(default=16, ge=2, description="Completions per prompt (G).")
    prompts_per_step: int = Field(default=16, ge=1, description="Prompts (groups) per training step.")
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature; the loss's log-probs use the same."
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off); as the loss's."
    )
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off); as the loss's.")
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="Completion length cap; None: the task's own cap."
    )
    policy_precision: Precision = Field(
        default="fp32",
        description="The weights the loss sees (``train.config.DerivedSettings``): fp32, the loop's own; "
        "bf16 / fp16 as a trainer peer of inference peers that hold that dtype (for benchmarks).",
    )
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="Loss and micro-batching settings.")
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig,
        description="AdamW settings: the same setting as a trainer peer's ``trainer.optimizer``.",
    )
    evaluation: EvalConfig = Field(
        default_factory=EvalConfig,
        description="Held-out evaluation between steps, as the publishing trainer's (train.evaluation).",
    )
    steps: int | None = Field(default=300, ge=1, description="Training steps to run; None: no step limit.")
    duration: float | None = Field(
        default=None,
        gt=0,
        description="Wall-clock budget in seconds; the run stops after the step that "
        "crosses it. None: no time limit. At least one of ``steps`` and ``duration`` must be set.",
    )
    seed: int = Field(default=0, description="Seed of the prompt order, of sampling and of torch's RNG.")
    threads: int | None = Field(
        default=None, ge=1, description="torch intra-op threads (None: leave torch's default)."
    )
    metrics_dir: UserPath | None = Field(
        default=None, description="Write one JSON line per step to <dir>/colocated-<name>.jsonl."
    )
    name: str = Field(default="baseline", description="Names the metrics file (the 'peer id' field).")
    log_every: int = Field(default=25, ge=1, description="Log a status line every this many steps.")
    standalone_pool: int | None = Field(
        default=None,
        ge=1,
        description="Standalone trainer: sample this many steps' worth of groups once, before the clock starts, "
        "and train on them round after round with no sampling in the loop: the most rollouts per second a "
        "decoupled trainer can consume at these settings (its reward curve means nothing: it relearns the "
        "same groups). None: sample every step (co-located).",
    )

    @model_validator(mode="after")
    def _check(self) -> ColocatedConfig:
        if self.steps is None and self.duration is None:
            raise ValueError("set steps, duration or both: the run needs an end")
        return self


class ColocatedTrainer:
    """Samples, scores and trains in turn in this process; see the module docstring.

    ``run()`` returns the per-step records (the same dicts that go to the metrics file, without the
    common fields). ``shutdown()`` (any thread, or a signal handler) ends the run after the current step.
    """

    def __init__(self, config: ColocatedConfig) -> None:
        import torch

        from echo_p2p.metrics import MetricsWriter
        from echo_p2p.ml.engine import TransformersEngine
        from echo_p2p.ml.models import load_policy
        from echo_p2p.ml.tokenizer import check_chat_template
        from echo_p2p.tasks.registry import build_task
        from echo_p2p.train.evaluation import Evaluator
        from echo_p2p.train.learner import Learner
        from echo_p2p.train.reference import reference_policy

        self.config = config
        self.stop_event = threading.Event()
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.task = build_task(config.task, config.task_options)
        self.model, self.tokenizer = load_policy(config.model)
        check_chat_template(self.tokenizer, self.task.conversational, config.model.use_chat_template)
        grpo = config.grpo
        # the loss's log-probs are those of this loop's own sampling
        derived = DerivedSettings(
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            pad_token_id=self.tokenizer.pad_token_id or 0,
            policy_precision=config.policy_precision,
        )
        reference = reference_policy(self.model, derived.policy_precision) if grpo.kl_beta > 0 else None
        self.learner = Learner(self.model, grpo, ref_model=reference, derived=derived)
        self.optimizer = config.optimizer.adamw(self.model.parameters())
        self.engine = TransformersEngine(self.model, self.tokenizer)
        self.sampling = SamplingParams(
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens or self.task.max_new_tokens,
        )
        self.evaluator = Evaluator(
            config.evaluation,
            self.task,
            self.tokenizer,
            self.engine,
            self.sampling,
            config.model.use_chat_template,
        )
        self.eval_records: list[dict[str, Any]] = []
        self.metrics = MetricsWriter(config.metrics_dir, role="colocated", peer_id=config.name)
        self.rng = random.Random(config.seed)
        self.version = 0
        self.rollouts_consumed = 0
        self.records: list[dict[str, Any]] = []

    def shutdown(self) -> None:
        self.stop_event.set()

    def sample_groups(
        self,
        step: int,
        engine: Any = None,
        prompt_ids: list[int] | None = None,
        version: int | None = None,
        group_size: int | None = None,
    ) -> tuple[list[Any], dict[str, float]]:
        """Groups of ``prompts_per_step`` fresh prompts (or ``prompt_ids``) sampled with this process's
        engine (or ``engine``: a benchmark's other sampler) and scored, ``group_size`` completions each (None:
        the run's G); tagged with the current version (or ``version``, the one ``engine`` holds)."""
        from echo_p2p.ml.tokenizer import decode_completion, encode_prompts
        from echo_p2p.rollout import Completion, RolloutGroup, Sampling
        from echo_p2p.train.scored import ScoredGroup

        cfg = self.config
        ids = (
            prompt_ids
            if prompt_ids is not None
            else self.task.sample_prompt_ids(self.rng, cfg.prompts_per_step)
        )
        prompts = encode_prompts(
            self.tokenizer, [self.task.prompt(i) for i in ids], cfg.model.use_chat_template
        )
        params = self.sampling.model_copy(update={"seed": (cfg.seed * 1_000_003 + step) % 2**63})
        t0 = time.perf_counter()
        sampler = engine or self.engine
        samples = sampler.sample(prompts, group_size or cfg.group_size, params)
        t1 = time.perf_counter()
        groups = []
        tokens = 0
        for pid, prompt, group in zip(ids, prompts, samples, strict=True):
            texts = [decode_completion(self.tokenizer, s.token_ids) for s in group]
            rewards = self.task.score_batch(
                [pid] * len(texts), texts, completion_ids=[s.token_ids for s in group]
            )
            comps = [
                Completion(token_ids=s.token_ids, logprobs=s.logprobs, claimed_reward=r, finished=s.finished)
                for s, r in zip(group, rewards, strict=True)
            ]
            tokens += sum(len(s.token_ids) for s in group)
            rollout = RolloutGroup(
                task=self.task.name,
                prompt_id=pid,
                prompt_token_ids=prompt,
                completions=comps,
                policy_version=self.version if version is None else version,
                sampler_peer_id=f"colocated-{cfg.name}",
                sampled_at=time.time(),
                sampling=Sampling(
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    engine="transformers",
                    precision=str(next(sampler.model.parameters()).dtype).removeprefix("torch."),
                ),
                sampling_seed=group[0].seed if group else "",
            )
            groups.append(ScoredGroup(rollout, rewards))
        t2 = time.perf_counter()
        return groups, {"sampling_s": t1 - t0, "scoring_s": t2 - t1, "tokens_sampled": float(tokens)}

    def run(self) -> list[dict[str, Any]]:
        cfg = self.config
        logger.info(
            "colocated run %r: task %s, G=%d x %d prompts, lr %g, %s",
            cfg.name,
            self.task.describe(),
            cfg.group_size,
            cfg.prompts_per_step,
            cfg.optimizer.lr,
            f"{cfg.steps} steps" if cfg.steps else f"{cfg.duration:.0f} s",
        )
        pool: list[Any] = []
        for index in range(cfg.standalone_pool or 0):  # before the clock: sampling is not what is measured
            pool.append(self.sample_groups(-1 - index)[0])
        start = time.perf_counter()
        step = 0
        self._maybe_evaluate()  # the starting policy, before the first update
        while not self.stop_event.is_set():
            if cfg.steps is not None and step >= cfg.steps:
                break
            if cfg.duration is not None and time.perf_counter() - start >= cfg.duration:
                break
            t0 = time.perf_counter()
            if pool:
                groups = pool[step % len(pool)]
                timing = {"sampling_s": 0.0, "scoring_s": 0.0, "tokens_sampled": 0.0}
            else:
                groups, timing = self.sample_groups(step)
            t1 = time.perf_counter()
            stats = self.learner.step(groups, self.optimizer, current_version=self.version)
            t2 = time.perf_counter()
            self.version += 1
            self.rollouts_consumed += len(groups)
            record = {
                "step": step,
                "wall_s": t2 - start,
                "step_s": t2 - t0,
                "sampling_s": timing["sampling_s"],
                "scoring_s": timing["scoring_s"],
                "training_s": t2 - t1,
                "reward_mean": stats["reward_mean"],
                "reward_std": stats["reward_std"],
                "rollouts": len(groups),
                "completions": int(stats["num_sequences"]),
                "rollouts_consumed": self.rollouts_consumed,
                "tokens_sampled": int(timing["tokens_sampled"]),
                "loss": stats["loss"],
                "grad_norm": stats["grad_norm"],
                "clip_frac": stats.get("clip_frac", 0.0),
                "completion_len_mean": stats.get("completion_len_mean_seq", 0.0),
                "frac_zero_adv_groups": stats["frac_zero_adv_groups"],
            }
            if "kl" in stats:  # the KL to the starting policy (kl_beta > 0)
                record["kl"] = stats["kl"]
            self.records.append(record)
            self.metrics.write(self.version, **record)
            if step % cfg.log_every == 0:
                logger.info(
                    "[colocated %s] version %d step %d: reward %.3f +- %.3f, sample %.3fs, train %.3fs, %.1fs",
                    cfg.name,
                    self.version,
                    step,
                    record["reward_mean"],
                    record["reward_std"],
                    record["sampling_s"],
                    record["training_s"],
                    record["wall_s"],
                )
            step += 1
            self._maybe_evaluate()
        return self.records

    def _maybe_evaluate(self) -> None:
        """Score the policy on the held-out prompts when due (the publishing trainer's rule and figures)."""
        if self.config.standalone_pool:
            return  # the standalone trainer relearns a fixed pool: its policy is not what is measured
        figures = self.evaluator.maybe_record(self.version, self.metrics, f"[colocated {self.config.name}]")
        if figures is not None:
            self.eval_records.append(figures)


def summarize(records: list[dict[str, Any]], window: int = 20) -> dict[str, float]:
    """Reward at the start and the end (means over ``window`` steps), seconds, and time fractions."""
    if not records:
        return {"steps": 0}
    n = min(window, len(records))
    sampling = sum(r["sampling_s"] + r["scoring_s"] for r in records)
    training = sum(r["training_s"] for r in records)
    busy = sampling + training
    return {
        "steps": len(records),
        "seconds": records[-1]["wall_s"],
        "reward_first": sum(r["reward_mean"] for r in records[:n]) / n,
        "reward_last": sum(r["reward_mean"] for r in records[-n:]) / n,
        "sampling_fraction": sampling / busy if busy else 0.0,  # the learner idles this share of the time
        "training_fraction": training / busy if busy else 0.0,  # the sampler idles this share
    }


# ----------------------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m echo_p2p.colocated",
        description="Co-located GRPO baseline: sample and train in turn in one process (the reference "
        "the swarm is compared with).",
    )
    p.add_argument("--task", default="count", help="task name (default: count)")
    add_task_option_flag(p)
    p.add_argument("--steps", type=int, default=300, help="training steps (default: 300; 0: no limit)")
    p.add_argument("--duration", type=float, default=None, help="time budget in seconds")
    p.add_argument("--metrics-dir", default=None, help="write colocated-<name>.jsonl here")
    p.add_argument("--name", default="baseline", help="run name in the metrics file name")
    p.add_argument("--model", default="tiny", help="preset ('tiny', 'smollm2') or a local model directory")
    p.add_argument("--group-size", type=int, default=16, help="completions per prompt (G)")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per step")
    p.add_argument(
        "--lr", type=float, default=None, help="AdamW learning rate (default: the preset's, else 1e-3)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling (and loss) temperature")
    p.add_argument("--micro-batch-size", type=int, default=GRPOConfig().micro_batch_size)
    p.add_argument(
        "--kl-beta",
        type=float,
        default=0.0,
        help="KL penalty to the starting policy (TRL's beta; default 0: no reference model)",
    )
    p.add_argument(
        "--eval-every",
        type=float,
        default=EvalConfig().every_seconds,
        metavar="S",
        help="score the held-out prompts every S seconds, within 5%% of the time (default: %(default)s)",
    )
    p.add_argument("--no-eval", action="store_true", help="no held-out evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument(
        "--standalone",
        type=int,
        default=None,
        metavar="STEPS",
        help="standalone trainer: sample STEPS steps' worth of groups once, then only train on them (the "
        "ceiling of a decoupled trainer's consumption)",
    )
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> ColocatedConfig:
    model = ModelSpec(preset=args.model) if args.model in ("tiny", "smollm2") else ModelSpec(path=args.model)
    return ColocatedConfig(
        model=model,
        task=args.task,
        task_options=dict(args.task_option),
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        optimizer=OptimizerConfig(lr=_lr(args)),
        temperature=args.temperature,
        grpo=dict(micro_batch_size=args.micro_batch_size, kl_beta=args.kl_beta),
        evaluation=EvalConfig(enabled=not args.no_eval, every_seconds=args.eval_every),
        steps=args.steps or None,
        duration=args.duration,
        seed=args.seed,
        threads=args.threads,
        metrics_dir=args.metrics_dir,
        name=args.name,
        log_every=args.log_every,
        standalone_pool=args.standalone,
    )


def _lr(args: argparse.Namespace) -> float:
    """``--lr``, else the preset's learning rate (``PRESET_TRAINER_DEFAULTS``), else ``OptimizerConfig``'s."""
    if args.lr is not None:
        return args.lr
    from echo_p2p.ml.models import PRESET_TRAINER_DEFAULTS

    return PRESET_TRAINER_DEFAULTS.get(args.model, {}).get("trainer.optimizer.lr", OptimizerConfig().lr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    trainer = ColocatedTrainer(config)
    install_stop_handlers(trainer.shutdown)
    try:
        records = trainer.run()
    finally:
        trainer.shutdown()
    summary = summarize(records)
    if trainer.eval_records:
        summary["eval_accuracy_first"] = trainer.eval_records[0]["eval_accuracy"]
        summary["eval_accuracy_last"] = trainer.eval_records[-1]["eval_accuracy"]
        summary["eval_seconds"] = trainer.evaluator.seconds_total
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
