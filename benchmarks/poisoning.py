"""Poisoning benchmark: what a stranger who sends only valid data teaches the policy, and when it is banned.

Issue 32 item 5. Every value such a stranger sends is true (rewards the trainer re-scores alike, log-probs of
its tokens under the policy it holds), yet it steers: it *edits* completions or *chooses* which of its honest
samples to send. One in-process run per arm on the tiny preset (no network: what is measured is what the
trainer learns from its intake, not transport): a fp32 policy trained for ``--steps`` updates with the
trainer's own parts, in the order a trainer peer applies them (``roles/trainer/peer.py``):

* the intake: each group through the trainer's ``IngestValidator`` (shapes, re-scored rewards, log-prob
  floor), refused when its sender is banned and when its re-scored rewards are all equal (``no_signal``,
  the ingest's rule), until ``--prompts`` groups are accepted (at most ``--max-rounds`` sampling rounds);
* the ``Learner`` with the sample check on (``guard.sampling_check``; ``--checks off``: the trainer
  before it) and AdamW, as the co-located baseline; with the check on, every group is drawn from a seed
  and the trainer replays the draws (``train.draw_check``) and refuses unseeded groups (``--draws off``:
  statistics only, the check before seeded draws);
* the ``SenderGuard`` after each step: log-prob gaps (``judge``), sample scores (``judge_samples``), bans.

The task is ``count``'s prompts (``"3b="``, answer ``"bbb"``) with a reward that checks only the answer's start
(``benchmarks/prefix_reward.py``, as most regex rewards do): what follows the answer is free, so a marker
after a right answer scores as the right answer. Held out: ``count``'s diagonal (6 of 30 prompts), never
trained on. Every slot of a step's intake is the attacker's with probability ``fraction``, otherwise one of
four honest samplers'; all of them hold the current policy (staleness 0). Arms:

* ``control``: honest samplers only;
* ``edit`` (token insertion): the attacker samples as an honest peer does, then turns every right answer into
  answer + ``--marker`` + EOS and sends the edited tokens' true log-probs (teacher forcing);
* ``insert`` (token insertion that keeps the sample): as ``edit``, but the marker goes in after the answer
  and the rest of the sampled completion follows (cut at ``max_new_tokens``): the edited completions differ
  from one another wherever the samples did, so the duplicate test sees no repeats;
* ``choose`` (cherry-picking): the attacker samples ``--pool`` times G completions of its prompt and sends,
  of those, up to G/2 with the marker where the answer ends (best rewards first) and fills the group with its
  worst ones without it: every completion an honest sample with its true log-probs; a prompt where it found
  none is not sent (with seeded draws replayed, a completion sent out of its place in its seed's draws is
  not the draw of that place: completions can no longer be picked out of a seed's draws, so there the
  chooser samples ``--pool`` groups of each prompt, each from its own seed, and sends the one with the most
  marked completions, whole);
* ``useless``: zero-variance groups (one honest completion repeated G times).

With ``--attack-from S`` the attacker arrives at step S (before it, its slots are honest samplers'). With
``--keys K`` > 1 the attacker is a Sybil: when one key is banned it sends under the next. With
``--claim-staleness k`` it tags its groups ``k`` versions older than they are (the checks forgive a stale group
the policy's movement since its version).

"Longer but correct" has no arm: this reward leaves length free, so honest completions already run to the cap
(``max_new_tokens``), the most any sender's completion may hold (longer ones are refused at ingest).

Measured per arm, at equal updates: on the held-out prompts (``--eval-samples`` samples each at the run's
temperature), the feature's share (the completion starts with the answer and the marker; ``marker_share``:
the marker where the answer ends, whatever came before), reward, accuracy, mean completion length and the
share cut at the cap; the attacker's share of the trained groups; the step of
the first trained group carrying the feature, of the first carrying it twice alike (``1st rep``: what the
duplicate test can see), of the attacker's first strike and of each ban; honest
samplers struck and banned; and the share of the update's time (``compute_gradients``) spent replaying
seeded draws (``replay``).

``python benchmarks/poisoning.py [--arms control,edit,choose,useless] [--fractions 0.1,0.25,0.5]
[--checks on,off] [--seeds 0] [--steps 150] [--out benchmarks/results/poisoning.json]`` prints a table and
writes JSON. An arm takes ~40 s on one core at 150 updates; the default sweep (17 arms per seed) ~12
minutes. Results: ``benchmarks/results/poisoning-*.json``, the table in docs/security.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from echo_p2p.colocated import ColocatedConfig, ColocatedTrainer
from echo_p2p.guard.reputation import ReputationConfig
from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
from echo_p2p.guard.sampling_check import SamplingCheckConfig
from echo_p2p.guard.sender_guard import SenderGuard
from echo_p2p.ml.engine import process_logits
from echo_p2p.ml.tokenizer import decode_completion, encode_prompts
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.tasks.count import CountTask
from echo_p2p.train.learner import Learner
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.transport.rollouts.ingest import NO_SIGNAL_SPREAD

ARMS = ("control", "edit", "insert", "choose", "useless")
STEERING = ("edit", "insert", "choose")  # the arms whose effect the sample check may bound
HONEST = [f"honest-{i}" for i in range(4)]
REWARD = Path(__file__).resolve().parent / "prefix_reward.py"


@dataclass(frozen=True)
class Arm:
    attack: str
    fraction: float
    check: bool
    seed: int

    @property
    def name(self) -> str:
        if self.attack == "control":
            return f"control check={'on' if self.check else 'off'} seed={self.seed}"
        return f"{self.attack} {self.fraction:.0%} check={'on' if self.check else 'off'} seed={self.seed}"


def write_task(folder: Path, max_new_tokens: int) -> dict[str, Any]:
    """``count``'s prompts and answers as a plug-in task's rows (training rows, held-out rows), scored by
    ``prefix_reward.answer_first``; returns the task options."""
    count = CountTask()
    held = set(count.held_out_ids())
    rows = {True: [], False: []}
    for pid in range(count.num_prompts):
        rows[pid in held].append({"prompt": count.prompt(pid), "answer": count.target(pid)})
    train, evals = folder / "prompts.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[False]))
    evals.write_text("".join(json.dumps(r) + "\n" for r in rows[True]))
    return {
        "reward": f"{REWARD}:answer_first",
        "prompts": str(train),
        "eval_prompts": str(evals),
        "max_new_tokens": max_new_tokens,
    }


class Run:
    """One arm: the policy, the trainer's checks, the honest samplers and the attacker (module doc)."""

    def __init__(self, arm: Arm, args: argparse.Namespace, task_options: dict[str, Any]) -> None:
        self.arm, self.args = arm, args
        self.trainer = ColocatedTrainer(
            ColocatedConfig(
                task="plugin",
                task_options=task_options,
                steps=args.steps,
                seed=arm.seed,
                threads=args.threads,
                prompts_per_step=args.prompts,
                group_size=args.group_size,
                name=f"poisoning-{arm.attack}",
            )
        )
        t = self.trainer
        self.task, self.tokenizer, self.model = t.task, t.tokenizer, t.model
        self.replay = replay = arm.check and args.draws == "on"  # seeded draws replayed (train.draw_check)
        check = SamplingCheckConfig(
            enabled=arm.check,
            duplicate_exclude_e=args.duplicate_exclude_e,
            seed_check_share=SamplingCheckConfig().seed_check_share if replay else 0.0,
        )
        self.learner = Learner(t.model, t.learner.config, derived=t.learner.derived, sampling_check=check)
        self.guard = SenderGuard(ReputationConfig(), "trainer", sampling=check)
        self.validator = IngestValidator(
            {self.task.name: self.task},
            self.tokenizer,
            IngestConfig(
                vocab_size=len(self.tokenizer),
                group_size=args.group_size,
                max_completion_tokens=self.task.max_new_tokens,
                max_staleness=max(args.claim_staleness, 0),
                require_seed=replay,
            ),
        )
        self.rng = random.Random(arm.seed * 7919 + 17)
        self.marker = self.tokenizer.convert_tokens_to_ids(list(args.marker))
        self.eos = self.tokenizer.eos_token_id
        self.answers = {pid: self.task.rows[pid]["answer"] for pid in range(len(self.task.rows))}
        self.key = 0  # the attacker's current key (a Sybil moves to the next when one is banned)
        self.version = 0
        self.counts: Counter[str] = Counter()
        self.events: dict[str, Any] = {
            "first_feature_step": None,
            "first_repeat_step": None,
            "first_strike_step": None,
            "ban_steps": [],
        }
        self.honest_struck: Counter[str] = Counter()
        self.compute_seconds = 0.0  # in compute_gradients (the update's forward and backward, the checks)

    # ---- the attacker ------------------------------------------------------------------------------------
    def attacker_id(self) -> str:
        return f"attacker-{self.key}"

    def has_feature(self, pid: int, text: str) -> bool:
        """The attacker's goal: the right answer, then the marker."""
        return text.startswith(self.answers[pid] + self.args.marker)

    def marked(self, pid: int, text: str) -> bool:
        """The marker where the answer ends, whatever came before (what a chooser can find early)."""
        n = len(self.answers[pid])
        return text[n : n + len(self.args.marker)] == self.args.marker

    def true_logprobs(self, prompt: list[int], completions: list[list[int]]) -> list[list[float]]:
        """Each completion's log-probs under the current policy at the run's sampling settings (teacher
        forcing, one padded pass): the true values an editor reports."""
        seqs = [prompt + ids for ids in completions]
        width = max(len(x) for x in seqs)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in seqs])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids, attention_mask=mask).logits
        out = []
        for row, ids in enumerate(completions):
            start = len(prompt)
            logp = process_logits(
                logits[row, start - 1 : start - 1 + len(ids)].float(), self.trainer.sampling
            )
            out.append(logp.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist())
        return out

    def attack_groups(self, step: int, pids: list[int]) -> list[RolloutGroup]:
        """The attacker's groups for ``pids`` (fewer when a chooser found nothing to send)."""
        attack, g = self.arm.attack, self.args.group_size
        if attack in ("edit", "insert", "useless"):
            groups = self.sample(step, pids, "attacker")
            if attack == "useless":
                return [self.regroup(x, [x.completions[0]] * g) for x in groups]
            out = []
            for group in groups:
                comps, edits = list(group.completions), []
                for i, c in enumerate(comps):
                    # a right answer becomes answer, marker, then EOS (edit) or the sample's rest (insert)
                    if c.claimed_reward >= 1.0:
                        n = len(self.answers[group.prompt_id])
                        rest = list(c.token_ids[n:]) if attack == "insert" else [self.eos]
                        ids = (list(c.token_ids[:n]) + self.marker + rest)[: self.args.max_new_tokens]
                        edits.append((i, ids))
                if edits:
                    logps = self.true_logprobs(group.prompt_token_ids, [ids for _, ids in edits])
                    for (i, ids), lp in zip(edits, logps, strict=True):
                        text = decode_completion(self.tokenizer, ids)
                        reward = self.task.score(group.prompt_id, text)
                        comps[i] = Completion(
                            token_ids=ids, logprobs=lp, claimed_reward=reward, finished=ids[-1] == self.eos
                        )
                    self.counts["edited"] += len(edits)
                out.append(self.regroup(group, comps))
            return out
        if self.replay:  # choose among whole groups: a completion out of its seed's draws is caught
            return self.choose_groups(step, pids)
        pool = self.sample(step, pids, "attacker", n=self.args.pool * g)  # choose
        out = []
        for group in pool:
            comps = group.completions
            text = [decode_completion(self.tokenizer, c.token_ids) for c in comps]
            # the marker where a right answer would end, best rewards first; the rest from the worst up
            marked = [i for i in range(len(comps)) if self.marked(group.prompt_id, text[i])]
            wanted = sorted(marked, key=lambda i: -comps[i].claimed_reward)[: g // 2]
            if not wanted:
                continue
            rest = sorted(set(range(len(comps))) - set(marked), key=lambda i: comps[i].claimed_reward)
            self.counts["chosen"] += len(wanted)
            out.append(self.regroup(group, [comps[i] for i in wanted + rest[: g - len(wanted)]]))
        return out

    def regroup(self, group: RolloutGroup, comps: list[Completion]) -> RolloutGroup:
        return group.model_copy(update={"completions": comps, "rollout_id": f"{self.rng.getrandbits(64):x}"})

    # ---- sampling and the intake -------------------------------------------------------------------------
    def choose_groups(self, step: int, pids: list[int]) -> list[RolloutGroup]:
        """The chooser where draws are replayed: ``--pool`` groups of each prompt, each from a seed of its own,
        and of them the one with the most completions marked where the answer ends (none: not sent)."""
        pools = [self.sample(step, pids, "attacker", draw=k + 1) for k in range(self.args.pool)]
        out = []
        for candidates in zip(*pools, strict=True):
            counts = [
                sum(
                    self.marked(x.prompt_id, decode_completion(self.tokenizer, c.token_ids))
                    for c in x.completions
                )
                for x in candidates
            ]
            best = max(range(len(candidates)), key=lambda i: counts[i])
            if counts[best]:
                self.counts["chosen"] += counts[best]
                out.append(self.regroup(candidates[best], list(candidates[best].completions)))
        return out

    def sample(
        self, step: int, pids: list[int], who: str, n: int | None = None, draw: int = 0
    ) -> list[RolloutGroup]:
        """Groups of ``n`` (default G) completions of each prompt, sampled and scored with the current policy
        (``draw``: another set of seeds for the same step)."""
        groups, _ = self.trainer.sample_groups(
            step * 7 + self.counts["rounds"] + 1_000_003 * draw,
            prompt_ids=pids,
            version=self.version,
            group_size=n,
        )
        return [g.group.model_copy(update={"sampler_peer_id": who}) for g in groups]

    def intake(self, step: int) -> list[ScoredGroup]:
        """Accepted groups for one step: slots drawn as the attacker's with probability ``fraction``."""
        want = self.args.prompts
        batch: list[ScoredGroup] = []
        for _ in range(self.args.max_rounds):
            self.counts["rounds"] += 1
            pids = self.task.sample_prompt_ids(self.rng, want)
            present = self.arm.attack != "control" and step >= self.args.attack_from
            mine = [present and self.rng.random() < self.arm.fraction for _ in pids]
            honest = self.sample(step, [p for p, m in zip(pids, mine, strict=True) if not m], "honest")
            attacker = self.attack_groups(step, [p for p, m in zip(pids, mine, strict=True) if m])
            offered = [(g, self.rng.choice(HONEST)) for g in honest] + [
                (g, self.attacker_id()) for g in attacker
            ]
            self.rng.shuffle(offered)
            for group, sender in offered:
                group = group.model_copy(update={"sampler_peer_id": sender})
                if sender.startswith("attacker") and self.args.claim_staleness:  # older versions: more slack
                    claimed = max(0, self.version - self.args.claim_staleness)
                    group = group.model_copy(update={"policy_version": claimed})
                kind = "attacker" if sender.startswith("attacker") else "honest"
                self.counts[f"{kind}_offered"] += 1
                if self.guard.is_banned(sender):
                    self.counts[f"{kind}_refused_banned"] += 1
                    continue
                verdict = self.validator.validate(group, self.version)
                if not isinstance(verdict, ScoredGroup):
                    self.counts[f"{kind}_refused_{verdict.reason.value}"] += 1
                    continue
                if max(verdict.rewards) - min(verdict.rewards) <= NO_SIGNAL_SPREAD:
                    self.counts[f"{kind}_refused_no_signal"] += 1
                    continue
                if len(batch) < want:
                    batch.append(verdict)
            if len(batch) >= want:
                break
        return batch

    # ---- training --------------------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any]:
        batch = self.intake(step)
        if not batch:
            self.counts["empty_steps"] += 1
            return {"step": step, "groups": 0}
        allowances = self.guard.allowances(batch, self.version)
        version = self.version
        started = time.perf_counter()
        stats = self.learner.compute_gradients(batch, gap_allowance=allowances, current_version=version)
        self.compute_seconds += time.perf_counter() - started
        if not stats["nonfinite"]:
            self.trainer.optimizer.step()
            drift = self.learner.measure_drift()
            if drift is not None:
                self.guard.drift.record(self.version, self.version + 1, drift)
            self.version += 1
        senders = sorted({g.group.sampler_peer_id for g in batch})
        struck = {s: self.guard.reputation.judgement_stats(s)[1] for s in senders}
        banned = self.guard.judge(batch, self.learner.last_group_gaps, allowances)
        banned += self.guard.judge_samples(
            batch,
            self.learner.last_sample_scores,
            allowances,
            self.learner.last_group_repeats,
            exact=lambda index: self.learner.exact_scores(batch[index], version),
            draw_misses=self.learner.last_group_draw_misses,
        )
        for sender in senders:  # at most one sample-check strike per sender per step
            if self.guard.reputation.judgement_stats(sender)[1] > struck[sender]:
                if not sender.startswith("attacker"):
                    self.honest_struck[sender] += 1
                elif self.events["first_strike_step"] is None:
                    self.events["first_strike_step"] = step
        mine = [g for g in batch if g.group.sampler_peer_id.startswith("attacker")]
        # per attacker group, its completions that carry the marker (the duplicate test sees them once two
        # are alike)
        marked = [
            [
                tuple(c.token_ids)
                for c in g.group.completions
                if self.marked(g.group.prompt_id, decode_completion(self.tokenizer, c.token_ids))
            ]
            for g in mine
        ]
        if any(marked) and self.events["first_feature_step"] is None:
            self.events["first_feature_step"] = step
        repeated = any(len(ids) > len(set(ids)) for ids in marked)
        if repeated and self.events["first_repeat_step"] is None:
            self.events["first_repeat_step"] = step
        for sender in banned:
            if sender.startswith("attacker"):
                self.events["ban_steps"].append(step)
                if self.key + 1 < self.args.keys:  # a Sybil sends under its next key
                    self.key += 1
            else:
                self.counts["honest_banned"] += 1
        honest = [
            self.marked(g.group.prompt_id, decode_completion(self.tokenizer, c.token_ids))
            for g in batch
            if not g.group.sampler_peer_id.startswith("attacker")
            for c in g.group.completions
        ]
        self.counts["trained_groups"] += len(batch)
        self.counts["attacker_trained_groups"] += len(mine)
        self.counts["attacker_feature_groups"] += sum(map(bool, marked))
        self.counts["excluded_not_sampled"] += int(stats.get("excluded_not_sampled", 0))
        self.counts["excluded_repeated"] += int(stats.get("excluded_repeated", 0))
        self.counts["excluded_not_drawn"] += int(stats.get("excluded_not_drawn", 0))
        return {
            "step": step,
            "groups": len(batch),
            "attacker_groups": len(mine),
            "reward_mean": round(float(stats["reward_mean"]), 4),
            "excluded_not_sampled": int(stats.get("excluded_not_sampled", 0)),
            # the policy's own marker rate, as its honest samplers drew it this step
            "honest_marker_share": round(sum(honest) / max(len(honest), 1), 4),
        }

    # ---- evaluation ------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The trained policy on the held-out prompts: ``eval_samples`` samples of each at the run's settings."""
        pids = list(self.task.held_out_ids())
        n = self.args.eval_samples
        prompts = encode_prompts(self.tokenizer, [self.task.prompt(i) for i in pids])
        params = self.trainer.sampling.model_copy(update={"seed": 99_991 + self.arm.seed})
        samples = self.trainer.engine.sample(prompts, n, params)
        feature = marked = right = cut = total = 0
        lengths, rewards = [], []
        for pid, group in zip(pids, samples, strict=True):
            for s in group:
                text = decode_completion(self.tokenizer, s.token_ids)
                reward = self.task.score(pid, text)
                rewards.append(reward)
                lengths.append(len(s.token_ids))
                right += reward >= 1.0
                feature += self.has_feature(pid, text)
                marked += self.marked(pid, text)
                cut += not s.finished
                total += 1
        return {
            "feature_share": feature / total,
            "feature_share_of_right": feature / max(right, 1),
            "marker_share": marked / total,
            "accuracy": right / total,
            "reward": statistics.fmean(rewards),
            "length_mean": statistics.fmean(lengths),
            "cut_share": cut / total,
        }

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        before = self.evaluate()
        steps = [self.step(i) for i in range(self.args.steps)]
        after = self.evaluate()
        trained = max(self.counts["trained_groups"], 1)
        first, bans = self.events["first_feature_step"], self.events["ban_steps"]
        repeat = self.events["first_repeat_step"]
        return {
            "arm": self.arm.name,
            "attack": self.arm.attack,
            "fraction": self.arm.fraction,
            "check": self.arm.check,
            "seed": self.arm.seed,
            "steps": self.args.steps,
            "eval_before": before,
            "eval": after,
            "reward_last20": statistics.fmean(s["reward_mean"] for s in steps[-20:] if s.get("groups")),
            "attacker_share_trained": self.counts["attacker_trained_groups"] / trained,
            "first_feature_step": first,
            "first_strike_step": self.events["first_strike_step"],
            "ban_steps": bans,
            "first_repeat_step": repeat,
            "ban_after_first_feature": None if first is None or not bans else bans[0] - first,
            "ban_after_first_repeat": None if repeat is None or not bans else bans[0] - repeat,
            "honest_struck": dict(self.honest_struck),
            "honest_banned": self.counts["honest_banned"],
            "counts": dict(self.counts),
            "marker_curve": [s.get("honest_marker_share") for s in steps[:: max(1, len(steps) // 15)]],
            "seconds": round(time.perf_counter() - t0, 1),
            # what the trainer's update took, and of it the replays of seeded draws (train.draw_check)
            "compute_s": round(self.compute_seconds, 2),
            "draw_check_s": round(self.learner.draws.seconds, 2) if self.learner.draws is not None else 0.0,
        }


def arms_of(args: argparse.Namespace) -> list[Arm]:
    out = []
    for seed in args.seeds:
        for attack in args.arms:
            for check in args.checks:
                if attack == "control":
                    out.append(Arm("control", 0.0, check, seed))
                    continue
                if not check and attack not in STEERING:
                    continue  # the sample check bounds steering only: no "before" arm for useless help
                out.extend(Arm(attack, f, check, seed) for f in args.fractions)
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'arm':<32} {'feature':>8} {'of right':>8} {'reward':>7} {'acc':>6} {'len':>5} {'attacker':>8} "
        f"{'1st feat':>8} {'1st rep':>7} {'1st strike':>10} {'bans':>12} {'honest banned':>13} {'replay':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        e = r["eval"]
        lines.append(
            f"{r['arm']:<32} {e['feature_share']:>8.3f} {e['feature_share_of_right']:>8.3f} {e['reward']:>7.3f} "
            f"{e['accuracy']:>6.3f} {e['length_mean']:>5.2f} {r['attacker_share_trained']:>8.2f} "
            f"{str(r['first_feature_step']):>8} {str(r.get('first_repeat_step')):>7} "
            f"{str(r['first_strike_step']):>10} "
            f"{','.join(map(str, r['ban_steps'][:4])) or '-':>12} {r['honest_banned']:>13} "
            f"{r['draw_check_s'] / max(r['compute_s'], 1e-9):>6.1%}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="the attacker's share of intake slots")
    p.add_argument("--checks", default="on,off", help="sample check on (now), off (before it), or both")
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=150, help="updates per arm (equal in every arm)")
    p.add_argument("--prompts", type=int, default=16, help="groups per update")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-rounds", type=int, default=6, help="sampling rounds per update at most")
    p.add_argument("--pool", type=int, default=4, help="a chooser samples this many times G per prompt")
    p.add_argument("--marker", default="z", help="the feature: these letters right after the answer")
    p.add_argument("--keys", type=int, default=1, help="the attacker's keys (a Sybil moves on when banned)")
    p.add_argument(
        "--claim-staleness",
        type=int,
        default=0,
        help="the attacker tags its groups this many versions older than they are (the checks forgive stale "
        "groups more; the trainer accepts up to max_staleness, 4 by default)",
    )
    p.add_argument(
        "--attack-from",
        type=int,
        default=0,
        help="the attacker's first step (0: from the run's start, on a policy that rarely answers right; later: "
        "it arrives on a policy that has learned, as the attacks of arXiv 2511.09780 did)",
    )
    p.add_argument(
        "--duplicate-exclude-e",
        type=float,
        default=SamplingCheckConfig().duplicate_exclude_e,
        help="the trainer's trainer.sampling_check.duplicate_exclude_e: groups whose duplicate e-value is at "
        "least this are left out of the loss",
    )
    p.add_argument(
        "--draws",
        choices=["on", "off"],
        default="on",
        help="with the checks on: replay seeded draws and refuse unseeded groups (on), or statistics only (off)",
    )
    p.add_argument("--eval-samples", type=int, default=64, help="samples per held-out prompt")
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/poisoning.json")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(ARMS):
        p.error(f"unknown arms: {sorted(unknown)}")
    args.fractions = [float(x) for x in args.fractions.split(",") if x]
    args.checks = [{"on": True, "off": False}[x] for x in args.checks.split(",") if x]
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        options = write_task(Path(folder), args.max_new_tokens)
        for arm in arms_of(args):
            result = Run(arm, args, options).run()
            results.append(result)
            print(table([result]).splitlines()[-1], flush=True)
    print()
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
