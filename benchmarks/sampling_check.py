"""Benchmark of ``guard.sampling_check``: is it quiet on honest samplers and quick on editors, and what it costs.

One in-process run on the tiny preset and the ``count`` task (no network): a fp32 policy is trained with
``ColocatedTrainer`` (the trainer's ``Learner`` and AdamW) for ``--steps`` updates. At a few checkpoints
along the way (``--checkpoints``: the untrained policy, while it learns, once it has learned) the trainer's
``Learner``, with the check on at each sampling setting, scores groups sampled by

* ``fp32``: the policy itself; ``bf16``: a bf16 copy (what an inference peer holds by default, bf16
  compute); ``bf16-stale``: a bf16 copy ``--stale`` updates old (the worst case of ``max_staleness``);
  ``int8``: the weights an inference peer holds when the run publishes the ``int8`` encoding (bitsandbytes'
  blockwise 8-bit quantiser, 4,096 per block, through ``weights.quant``; fp32 compute); ``nf4``: every
  linear layer's weight through bitsandbytes' 4-bit NF4 quantiser (blocks of 64), bf16 compute, as a
  ``Linear4bit`` layer computes (dequantised weights; activations are not quantised),

at temperature 1.0 and 0.7, with and without top-p 0.9 (the Learner's distribution is the fp32 policy's at
the same settings: it recomputes it as a trainer does). Calibration, per sampler and setting: the
completions' standardised surprisal z (mean, sd), the share of completions left out of the loss, the
groups with one left out, the highest per-sender detector level reached and the alarms (strikes; 3 ban)
of one detector fed every completion of that sampler in order, the same of its duplicate test (every
group's duplicate evidence through ``SampleDetector.observe_repeats``), and the replays of its seeded draws
(``train.draw_check``): completions replayed, those not found to be their seed's draw at ``seed_tolerance``,
and the farthest any token's uniform fell outside its interval (what ``seed_tolerance`` must cover).

Detection, on the learned policy: an *editor* that appends a two-letter marker before EOS to each right
answer (issue 32's token insertion) and one that replaces ``k`` tokens of every completion by tokens drawn
uniformly from the vocabulary (most of which the policy finds unlikely), each sending its groups one after
the other to a fresh detector and ``Reputation`` (defaults): groups and completion tokens until its first
strike and until its ban, and the share of its edited completions left out of the loss.

Cost: ``Learner.compute_gradients`` on the same groups with the check off and on, interleaved, median of
``--repeats``: the added seconds and their ratio to the step; with ``--smollm2-cost`` also on SmolLM2-135M's
architecture (random weights, 49,152-token vocabulary, top-p 0.9), where the vocabulary is 850x the tiny one.

``python benchmarks/sampling_check.py [--steps 120] [--seed 0] [--smollm2-cost]
[--out benchmarks/results/sampling_check.json]`` prints the tables and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer
from echo_p2p.guard.reputation import Reputation
from echo_p2p.guard.sampling_check import CompletionScore, SampleDetector, SamplingCheckConfig
from echo_p2p.ml.engine import SamplingParams, TransformersEngine
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.quant import dequantize, quantize_blockwise

SETTINGS = [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9)]
#: the precision each sampler's groups claim (what an inference peer of that kind reports)
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "bf16-stale": "bfloat16", "int8": "8bit", "nf4": "4bit"}
CHECK = SamplingCheckConfig()


def scores_of(
    learner: Learner, groups: list[ScoredGroup], allowance: float = 0.0, current_version: int | None = None
) -> tuple[list[list[CompletionScore]], int, list[float | None]]:
    """The check's completion scores of ``groups`` through the learner's own path (each group allowed
    ``allowance``: the measured drift since its version), how many completions it left out (tail bound or
    repeats), and each group's duplicate evidence (log e-value)."""
    stats = learner.compute_gradients(
        groups, gap_allowance=[allowance] * len(groups), current_version=current_version
    )
    learner.model.zero_grad(set_to_none=True)
    left_out = int(stats["excluded_not_sampled"] + stats["excluded_repeated"] + stats["excluded_not_drawn"])
    return learner.last_sample_scores, left_out, learner.last_group_repeats


def feed(
    groups_scores: list[list[CompletionScore]],
    allowances: list[float] | None = None,
    repeats: list[float | None] | None = None,
) -> dict[str, Any]:
    """One sender's completions, in order, through a fresh detector and reputation: strikes, ban, level;
    with ``repeats`` (each group's duplicate evidence) also its groups through the duplicate detector."""
    detector, reputation = SampleDetector(CHECK), Reputation()
    out: dict[str, Any] = {"strike_group": None, "ban_group": None, "strike_tokens": None, "ban_tokens": None}
    tokens, top, alarms, repeat_top, repeat_alarms = 0, 0.0, 0, 0.0, 0
    allowances = allowances or [0.0] * len(groups_scores)
    for index, (group, allowance) in enumerate(zip(groups_scores, allowances, strict=True)):
        if repeats is not None and repeats[index] is not None:
            repeat_alarms += detector.observe_repeats("s", repeats[index])
            repeat_top = max(repeat_top, detector.repeat_level("s"))
        for score in group:
            tokens += score.tokens
            if detector.observe("s", score, allowance):
                alarms += 1
                if out["strike_group"] is None:
                    out["strike_group"], out["strike_tokens"] = index + 1, tokens
                if reputation.strike("s", "not_sampled", now=float(index)) and out["ban_group"] is None:
                    out["ban_group"], out["ban_tokens"] = index + 1, tokens
            top = max(top, detector.level("s"))
    out.update(alarms=alarms, max_level=top, threshold=detector.threshold, tokens=tokens)
    out.update(repeat_alarms=repeat_alarms, max_repeat_level=repeat_top)
    return out


def claiming(scored: ScoredGroup, precision: str) -> ScoredGroup:
    """``scored`` with its group saying it was sampled at ``precision``."""
    sampling = scored.group.sampling.model_copy(update={"precision": precision})
    return ScoredGroup(scored.group.model_copy(update={"sampling": sampling}), scored.rewards)


def bf16_engine(model: torch.nn.Module, tokenizer: Any) -> TransformersEngine:
    return TransformersEngine(copy.deepcopy(model).to(torch.bfloat16), tokenizer)


def int8_engine(model: torch.nn.Module, tokenizer: Any) -> TransformersEngine:
    """Every float weight through the ``int8`` stream encoding's quantiser and back (fp32, as receivers of
    that encoding hold it)."""
    blocksize = EncodingConfig().blocksize
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for param in copied.parameters():
            if param.numel():
                absmax, codes = quantize_blockwise(param.detach().reshape(-1).float().contiguous(), blocksize)
                param.copy_(dequantize(absmax, codes, blocksize).reshape(param.shape))
    return TransformersEngine(copied, tokenizer)


def nf4_engine(model: torch.nn.Module, tokenizer: Any) -> TransformersEngine:
    """Every linear layer's weight through bitsandbytes' NF4 quantiser and back, bf16 compute."""
    import bitsandbytes.functional as bnbf

    copied = copy.deepcopy(model)
    with torch.no_grad():
        for module in copied.modules():
            if isinstance(module, torch.nn.Linear):
                packed, state = bnbf.quantize_4bit(
                    module.weight.detach().float().contiguous(), quant_type="nf4"
                )
                module.weight.copy_(bnbf.dequantize_4bit(packed, state).reshape(module.weight.shape))
    return TransformersEngine(copied.to(torch.bfloat16), tokenizer)


def learner_at(trainer: ColocatedTrainer, temperature: float, top_p: float, check: bool = True) -> Learner:
    derived = dataclasses.replace(trainer.learner.derived, temperature=temperature, top_p=top_p)
    return Learner(
        trainer.model, trainer.learner.config, derived=derived, sampling_check=CHECK if check else None
    )


def edited(trainer: ColocatedTrainer, groups: list[ScoredGroup], attack: str, k: int, rng: random.Random):
    """``groups`` with their completions edited: ``marker`` (two letters before EOS on right answers) or
    ``replace`` (``k`` tokens of each completion swapped for uniform random ones); the edited completions'
    log-probs are left as they were (the check does not read them)."""
    tok = trainer.tokenizer
    marker = tok.convert_tokens_to_ids(["z", "q"])
    eos = tok.eos_token_id
    vocab = len(tok)
    out, edits = [], 0
    for scored in groups:
        comps = []
        for comp, reward in zip(scored.group.completions, scored.rewards, strict=True):
            ids = list(comp.token_ids)
            if attack == "marker" and reward >= 1.0:
                body = ids[:-1] if ids and ids[-1] == eos else ids
                ids = body + marker + ([eos] if ids and ids[-1] == eos else [])
                edits += 2
            elif attack == "replace":
                for pos in rng.sample(range(len(ids)), min(k, len(ids))):
                    ids[pos] = rng.randrange(vocab)
                    edits += 1
            comps.append(Completion(token_ids=ids, logprobs=[-1.0] * len(ids), claimed_reward=reward))
        group = RolloutGroup(**{**scored.group.model_dump(), "completions": comps})
        out.append(ScoredGroup(group, scored.rewards))
    return out, edits


def timed(
    learners: dict[str, Learner], groups: list[ScoredGroup], repeats: int, current_version: int | None = None
) -> dict[str, float]:
    """Median seconds of ``compute_gradients`` on ``groups`` per learner (interleaved), the check's share."""
    times: dict[str, list[float]] = {arm: [] for arm in learners}
    for _ in range(repeats):
        for arm, learner in learners.items():
            t0 = time.perf_counter()
            learner.compute_gradients(groups, current_version=current_version)
            times[arm].append(time.perf_counter() - t0)
    cost = {arm: statistics.median(v) for arm, v in times.items()}
    cost.update({f"{arm}_min": min(v) for arm, v in times.items()})
    cost["added_s"] = cost["on"] - cost["off"]
    cost["ratio"] = cost["added_s"] / cost["off"]
    # on a shared machine the fastest of each arm is the least disturbed
    cost["ratio_min"] = (cost["on_min"] - cost["off_min"]) / cost["off_min"]
    return cost


def stale_cost(trainer: ColocatedTrainer, groups: list[ScoredGroup], behind: int, repeats: int):
    """``timed`` on ``groups`` spread round-robin over the ``behind`` versions before the trained one (whose
    weights the learner keeps: the policy's own here, only the time matters), as an async run's batches are;
    the senders' probations are spent first, so the replays are the steady share's."""
    current = 100
    spread = [
        ScoredGroup(g.group.model_copy(update={"policy_version": current - 1 - i % behind}), g.rewards)
        for i, g in enumerate(groups)
    ]
    learners = {arm: learner_at(trainer, 1.0, 1.0, check=arm == "on") for arm in ("off", "on")}
    on = learners["on"]
    assert on.past is not None and on.draws is not None
    for version in range(current - behind, current):
        on.past.record(version)
    for _ in range(CHECK.seed_probation + 1):
        on.draws.pick(spread)
    cost = timed(learners, spread, repeats, current_version=current)
    cost["replayed_per_step"] = on.draws.replayed / max(1, repeats)
    cost["replay_s_per_step"] = on.draws.seconds / max(1, repeats)  # of ``added_s``: the draws' part
    return cost


def smollm2_cost(repeats: int, groups: int, group_size: int, length: int) -> dict[str, float]:
    """The check's share of ``compute_gradients`` on SmolLM2-135M's architecture (random weights: only the
    time matters; 49,152-token vocabulary), ``groups`` x ``group_size`` completions of ``length`` tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from echo_p2p.train.config import DerivedSettings, GRPOConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    rng = random.Random(0)
    batch = []
    for prompt_id in range(groups):
        comps = [
            Completion(
                token_ids=[rng.randrange(2, 49152) for _ in range(length)],
                logprobs=[-10.0] * length,
                claimed_reward=0.0,
            )
            for _ in range(group_size)
        ]
        group = RolloutGroup(
            task="t",
            prompt_id=prompt_id,
            prompt_token_ids=[rng.randrange(2, 49152) for _ in range(32)],
            completions=comps,
            policy_version=0,
            sampler_peer_id="s",
        )
        batch.append(ScoredGroup(group, [float(i % 2) for i in range(group_size)]))
    grpo, derived = GRPOConfig(), DerivedSettings(top_p=0.9)
    learners = {
        arm: Learner(model, grpo, derived=derived, sampling_check=CHECK if arm == "on" else None)
        for arm in ("off", "on")
    }
    return timed(learners, batch, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[0, 60, 90, 120])
    parser.add_argument("--groups", type=int, default=8, help="groups per sampler, setting and checkpoint")
    parser.add_argument("--attack-groups", type=int, default=12)
    parser.add_argument("--stale", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--cost-only", action="store_true", help="only time the check (untrained policy), print and exit"
    )
    parser.add_argument(
        "--cost-behind",
        type=int,
        default=0,
        help="also time the check on the same groups spread over this many versions behind the trained one "
        "(an async run's batch: replays under the kept weights), every sender past its probation",
    )
    parser.add_argument(
        "--smollm2-cost", action="store_true", help="also time the check on SmolLM2-135M's architecture"
    )
    parser.add_argument("--out", default="benchmarks/results/sampling_check.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    trainer = ColocatedTrainer(
        ColocatedConfig(steps=args.steps, seed=args.seed, threads=args.threads, prompts_per_step=16)
    )
    optimizer = trainer.optimizer
    if args.cost_only:
        groups, _ = trainer.sample_groups(10**8)
        learners = {arm: learner_at(trainer, 1.0, 1.0, check=arm == "on") for arm in ("off", "on")}
        costs = {"tiny": timed(learners, groups, args.repeats)}
        if args.cost_behind > 0:
            costs[f"tiny_stale{args.cost_behind}"] = stale_cost(
                trainer, groups, args.cost_behind, args.repeats
            )
        if args.smollm2_cost:
            costs["smollm2_arch"] = smollm2_cost(3, 2, 4, 32)
        for name, cost in costs.items():
            print(
                f"{name}: compute_gradients off {cost['off']:.4f} s (min {cost['off_min']:.4f}), on {cost['on']:.4f} s "
                f"(min {cost['on_min']:.4f}): +{cost['ratio'] * 100:.1f}% by medians, +{cost['ratio_min'] * 100:.1f}% by minima"
            )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "cost": costs}, indent=1))
        return 0
    history: list[dict[str, torch.Tensor]] = []
    honest: dict[tuple[str, float, float], dict[str, Any]] = {}
    rewards, drifts = [], []
    for step in range(args.steps + 1):
        history = [*history[-args.stale :], {k: v.clone() for k, v in trainer.model.state_dict().items()}]
        if step in args.checkpoints:
            stale_model = copy.deepcopy(trainer.model)
            stale_model.load_state_dict(history[0])
            engines = {
                "fp32": trainer.engine,
                "bf16": bf16_engine(trainer.model, trainer.tokenizer),
                "bf16-stale": bf16_engine(stale_model, trainer.tokenizer),
                "int8": int8_engine(trainer.model, trainer.tokenizer),
                "nf4": nf4_engine(trainer.model, trainer.tokenizer),
            }
            for (temperature, top_p), (kind, engine) in ((s, e) for s in SETTINGS for e in engines.items()):
                learner = learner_at(trainer, temperature, top_p)
                trainer.sampling = SamplingParams(
                    temperature=temperature, top_p=top_p, max_new_tokens=trainer.task.max_new_tokens
                )
                entry = honest.setdefault(
                    (kind, temperature, top_p),
                    {
                        "scores": [],
                        "excluded": 0,
                        "flagged": 0,
                        "allowances": [],
                        "repeats": [],
                        "draws": {"replayed": 0, "missed": 0, "largest_distance": 0.0},
                    },
                )
                # the trainer measures its drift at the run's temperature: logits moving by d move its
                # log-probs by about d / T; this run trains at T = 1
                allowance = sum(drifts[-args.stale :]) / temperature if kind == "bf16-stale" else 0.0
                for g in range(args.groups // 8 or 1):
                    # tagged with the version that sampled them (the stale copy's is --stale updates old)
                    behind = min(args.stale, step) if kind == "bf16-stale" else 0
                    groups, _ = trainer.sample_groups(step * 1000 + g, engine=engine, version=step - behind)
                    groups = [claiming(x, PRECISIONS[kind]) for x in groups[: args.groups]]
                    scores, excluded, repeats = scores_of(learner, groups, allowance, current_version=step)
                    entry["scores"] += scores
                    entry["repeats"] += repeats
                    entry["allowances"] += [allowance] * len(scores)
                    entry["excluded"] += excluded
                    entry["flagged"] += sum(
                        any(s.p_value(CHECK.drift_allowance * allowance) < CHECK.exclude_p_value for s in gs)
                        for gs in scores
                    )
                # replays of the seeded draws under the version the groups claim (train.draw_check; a stale
                # group's version is not kept by this fresh learner: not replayed)
                draws = entry["draws"]
                draws["replayed"] += learner.draws.replayed
                draws["missed"] += learner.draws.missed
                draws["largest_distance"] = max(draws["largest_distance"], learner.draws.largest_distance)
            trainer.sampling = SamplingParams(temperature=1.0, max_new_tokens=trainer.task.max_new_tokens)
        if step == args.steps:
            break
        groups, _ = trainer.sample_groups(step)
        stats = trainer.learner.step(groups, optimizer)
        rewards.append(stats["reward_mean"])
        drifts.append(trainer.learner.measure_drift() or 0.0)

    calibration = []
    for (kind, temperature, top_p), entry in honest.items():
        flat = [s for g in entry["scores"] for s in g]
        zs = [s.z for s in flat if s.variance > 0]
        sender = feed(entry["scores"], entry["allowances"], entry["repeats"])
        calibration.append(
            {
                "sampler": kind,
                "temperature": temperature,
                "top_p": top_p,
                "groups": len(entry["scores"]),
                "completions": len(flat),
                "tokens": sum(s.tokens for s in flat),
                "z_mean": statistics.mean(zs),
                "z_sd": statistics.stdev(zs),
                "tail_per_token": sum(s.tail for s in flat) / max(1, sum(s.tokens for s in flat)),
                "min_p_value": min(
                    s.p_value(CHECK.drift_allowance * a)
                    for gs, a in zip(entry["scores"], entry["allowances"], strict=True)
                    for s in gs
                ),
                "mean_allowance": statistics.mean(entry["allowances"]),
                "completions_excluded": entry["excluded"],
                "groups_flagged": entry["flagged"],
                "max_level": sender["max_level"],
                "threshold": sender["threshold"],
                "strikes": sender["alarms"],
                "max_repeat_level": sender["max_repeat_level"],
                "repeat_strikes": sender["repeat_alarms"],
                "banned": sender["ban_group"] is not None,
                "draws_replayed": entry["draws"]["replayed"],
                "draws_missed": entry["draws"]["missed"],
                "draw_largest_distance": entry["draws"]["largest_distance"],
                "scores": [
                    [s.tokens, round(s.tail, 4), a]
                    for gs, a in zip(entry["scores"], entry["allowances"], strict=True)
                    for s in gs
                ],
            }
        )

    rng = random.Random(args.seed)
    detection = []
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        learner = learner_at(trainer, temperature, top_p)
        trainer.sampling = SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=trainer.task.max_new_tokens
        )
        engine = bf16_engine(trainer.model, trainer.tokenizer)
        base = trainer.sample_groups(10**7, engine=engine)[0][: args.attack_groups]
        for attack, k in [("marker", 2), ("replace", 1), ("replace", 2), ("none", 0)]:
            groups, edits = edited(trainer, base, attack, k, rng) if attack != "none" else (base, 0)
            replayed, missed = learner.draws.replayed, learner.draws.missed
            scores, excluded, repeats = scores_of(learner, groups)
            sender = feed(scores, repeats=repeats)
            detection.append(
                {
                    "attack": attack if attack != "replace" else f"replace-{k}",
                    "temperature": temperature,
                    "top_p": top_p,
                    "groups": len(groups),
                    "edited_tokens": edits,
                    "completions_excluded": excluded,
                    "completions": sum(len(g) for g in scores),
                    "strike_group": sender["strike_group"],
                    "ban_group": sender["ban_group"],
                    "strike_tokens": sender["strike_tokens"],
                    "ban_tokens": sender["ban_tokens"],
                    # replays of their seeded draws: completions replayed, and of them not their seed's draw
                    "draws_replayed": learner.draws.replayed - replayed,
                    "draws_missed": learner.draws.missed - missed,
                }
            )

    groups, _ = trainer.sample_groups(10**8)
    learners = {arm: learner_at(trainer, 1.0, 1.0, check=arm == "on") for arm in ("off", "on")}
    cost = timed(learners, groups, args.repeats)
    trainer.model.zero_grad(set_to_none=True)
    big = smollm2_cost(3, 2, 4, 32) if args.smollm2_cost else None

    print("calibration (honest samplers; strikes: detector alarms, 3 ban)")
    print(
        f"{'sampler':<11}{'T':>5}{'top_p':>6}{'compl':>7}{'z mean':>8}{'z sd':>6}{'x/tok':>7}"
        f"{'min p':>9}{'excl':>5}{'grp flag':>9}{'max lvl':>8}{'strikes':>8}{'rep lvl':>8}{'rep str':>8}"
        f"{'banned':>7}{'allow':>7}{'replayed':>9}{'missed':>7}{'max dist':>9}"
    )
    for row in calibration:
        row = {k: v for k, v in row.items() if k != "scores"}
        print(
            f"{row['sampler']:<11}{row['temperature']:>5}{row['top_p']:>6}{row['completions']:>7}"
            f"{row['z_mean']:>8.2f}{row['z_sd']:>6.2f}{row['tail_per_token']:>7.2f}{row['min_p_value']:>9.1e}"
            f"{row['completions_excluded']:>5}{row['groups_flagged']:>9}{row['max_level']:>8.1f}"
            f"{row['strikes']:>8}{row['max_repeat_level']:>8.1f}{row['repeat_strikes']:>8}"
            f"{row['banned']!s:>7}{row['mean_allowance']:>7.2f}{row['draws_replayed']:>9}{row['draws_missed']:>7}"
            f"{row['draw_largest_distance']:>9.2e}"
        )
    print("\ndetection (learned policy, bf16 sampler; one group per prompt, G completions)")
    print(
        f"{'attack':<11}{'T':>5}{'top_p':>6}{'groups':>7}{'excl/compl':>11}{'strike@grp':>11}"
        f"{'ban@grp':>8}{'ban@tok':>8}{'replayed':>9}{'missed':>7}"
    )
    for row in detection:
        print(
            f"{row['attack']:<11}{row['temperature']:>5}{row['top_p']:>6}{row['groups']:>7}"
            f"{row['completions_excluded']:>5}/{row['completions']:<5}{row['strike_group']!s:>11}"
            f"{row['ban_group']!s:>8}{row['ban_tokens']!s:>8}{row['draws_replayed']:>9}{row['draws_missed']:>7}"
        )
    if big is not None:
        print(
            f"cost, SmolLM2-135M architecture (2 x 4 completions of 32 tokens, top-p 0.9): "
            f"{big['off']:.2f} s off, {big['on']:.2f} s on: +{big['ratio'] * 100:.1f}%"
        )
    print(
        f"\ncost: compute_gradients {cost['off'] * 1e3:.1f} ms off, {cost['on'] * 1e3:.1f} ms on: "
        f"+{cost['ratio'] * 100:.1f}%"
    )
    result = {
        "args": vars(args),
        "train_reward_last10": statistics.mean(rewards[-10:]),
        "calibration": calibration,
        "detection": detection,
        "cost": cost,
        "cost_smollm2_arch": big,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}; train reward (last 10 steps) {result['train_reward_last10']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
