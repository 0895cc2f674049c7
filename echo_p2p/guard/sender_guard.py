"""A trainer's defence against senders that lie about their behaviour log-probs.

Owned here: ``SenderGuard``, which the trainer peer feeds after every step with the groups it trained on
and the learner's per-group log-prob gaps (``Learner.last_group_gaps``; completions above the gap were
already left out of the loss), each allowed as much more as the trainer's own policy moved since the
group's version (``guard.drift``: the trainer records every update's measured movement in ``drift``).
It also feeds each completion's sample score (``Learner.last_sample_scores``) and each group's duplicate
evidence (``Learner.last_group_repeats``) to its sender's detectors (``guard.sampling_check``): an alarm is a
strike (``not_sampled``). Repeat offenders are banned
(``guard.reputation``): the ingest refuses their pushes before reading them and their groups leave the
buffer. The guard publishes this trainer's bans on the DHT (``BanRecord``) and adopts the bans of the run's other *trusted* trainers (a run that declares no
trainers shares none: anyone could ban an honest peer). Every DHT call is bounded by the directory.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from echo_p2p.guard.drift import PolicyDrift
from echo_p2p.guard.reputation import Reputation, ReputationConfig
from echo_p2p.guard.sampling_check import CompletionScore, SampleDetector, SamplingCheckConfig
from echo_p2p.net.records import Ban, BanRecord

logger = logging.getLogger(__name__)


class SenderGuard:
    def __init__(
        self,
        config: ReputationConfig,
        peer_id: str,
        buffer=None,
        trust=None,
        sampling: SamplingCheckConfig | None = None,
    ) -> None:
        self.reputation = Reputation(config)
        #: per-sender tests that its completions are samples (``guard.sampling_check``); None: off
        self.samples = SampleDetector(sampling) if sampling is not None and sampling.enabled else None
        self.drift = PolicyDrift()  # how far this trainer's policy moved: the trainer records each update
        self.peer_id = peer_id
        self.buffer = buffer
        self.trust = trust
        self.counters: Counter[str] = Counter()
        self._published: tuple = ()

    def is_banned(self, sender: str) -> bool:
        return self.reputation.is_banned(sender)

    def allowances(self, groups, version: int) -> list[float | None]:
        """Per group: how far this trainer's policy moved since the group's version (``PolicyDrift.since``),
        the allowance on top of the gap limits; None where that is unknown."""
        return [self.drift.since(scored.policy_version, version) for scored in groups]

    def judge(self, groups, gaps: list[float], allowances: list[float | None]) -> list[str]:
        """Record each trained group's gap against its sender (a group whose allowance is unknown is not
        judged); returns the senders banned by it."""
        banned = []
        limit = self.reputation.config.max_logprob_gap
        worst: dict[str, tuple[int, float, float]] = {}  # sender -> (strikes in this batch, gap, allowance)
        for scored, gap, allowance in zip(groups, gaps, allowances, strict=False):
            sender = scored.group.sampler_peer_id
            if allowance is None:
                self.counters["groups_unjudged"] += 1
                continue
            if limit is not None and gap > limit + allowance:
                count, top, top_allowance = worst.get(sender, (0, 0.0, 0.0))
                worst[sender] = (count + 1, *((gap, allowance) if gap > top else (top, top_allowance)))
            if self.reputation.record(sender, gap, allowance):
                banned.append(sender)
                self._banned(
                    sender, f"behaviour log-probs off by up to {gap:.2f} nats per token on most of its groups"
                )
        for sender, (count, gap, allowance) in worst.items():
            logger.info(
                "%d strike(s) against %s: behaviour log-probs off by up to %.2f nats per token (limit %.2f, "
                "plus %.2f the policy moved since the group's version)",
                count,
                sender,
                gap,
                limit,
                allowance,
            )
        return banned

    def judge_samples(
        self,
        groups,
        scores: list[list[CompletionScore]],
        allowances: list[float | None],
        repeats: list[float | None] | None = None,
        exact: Callable[[int], list[CompletionScore] | None] | None = None,
        draw_misses: list[Any] | None = None,
        known: Callable[[Any], bool] | None = None,
    ) -> list[str]:
        """Feed each trained group's completion scores (``Learner.last_sample_scores``) to its sender's
        detector, with the group's allowance (``allowances``: a group whose allowance is unknown is not
        judged), and its duplicate evidence (``repeats``: ``Learner.last_group_repeats``) to the sender's
        duplicate detector; an alarm of either is a strike (``not_sampled``); returns the senders banned by it.

        At most one strike per sender per batch (the rest of its completions in the batch are not fed once
        its detector alarmed): each batch is one judgement of the sender (``Reputation.judged``), whose ban
        needs strikes in at least ``ban_fraction`` of its last ``recent_judgements`` judgements, as the gap
        check needs them on that share of its groups. Alarms are not independent evidence when the policy
        itself just moved far (an update the drift allowance underestimates): a local run whose policy was
        shaken by an editor's groups struck each honest sampler 4-12 times within one second and banned
        both. An editor alarms in most batches once the policy has learned: banned at its third strike, or,
        after a clean stretch (before the policy learned there was little to edit), once its strikes are
        half of its recent batches. A duplicate alarm is exact evidence (no shake to forgive where the
        learner kept the group's version): the ``duplicate_ban_alarms``-th within the window bans at once
        (``Reputation.alarmed``).

        ``exact`` (``Learner.exact_scores`` of the group at that index): where the tail test would strike a
        stale group, its scores under the version it claims, or None; the group is judged on those instead
        (``SampleDetector.observe_group``).

        ``draw_misses`` (``Learner.last_group_draw_misses``): per group, the replay of its seeded draws
        (``train.draw_check.Replay``). A group with a completion that is not its seed's draw is a strike, and the
        ``seed_ban_alarms``-th within the window bans its sender at once (``Reputation.alarmed``): a replay
        is exact, bar a sampler whose probabilities differ from the trainer's by more than its precision's
        ``seed_tolerance``; a group missed by more than twice that (``Replay.gross``) bans at its first.

        ``known(group)``: whether the weights the learner kept of the group's version are known to be the ones
        its sampler had (``TrainerPeer._weights_known``: the trainer's state of that epoch was shared by every
        trainer of its gradient round, or the trainer published that version on the stream the group names and
        still holds those weights: ``roles.trainer.known_weights``; None: always). Replays and exact scores are exact only under those weights: a trainer whose round came
        back partial, or that stepped alone while another published, holds other weights under the same
        version number, and honest samplers' draws miss them by 0.1-0.2 of the probability mass (chaos soaks
        saw every sampler banned that way and the run stall for 350 s).
        A miss under weights not known so is counted (``draw_misses_unknown``), its group stays out of the
        loss (the learner left it out), and nobody is struck for it; the tail test then judges the group
        with the drift allowance, as it does a group whose version was not kept."""
        if self.samples is None:
            return []
        banned: list[str] = []
        struck: dict[str, str] = {}  # sender -> what alarmed
        judged: dict[str, None] = {}  # senders in the order first seen
        for index, (scored, group_scores, allowance) in enumerate(
            zip(groups, scores, allowances, strict=False)
        ):
            sender = scored.group.sampler_peer_id
            if sender in struck:
                continue
            replay = draw_misses[index] if draw_misses is not None and index < len(draw_misses) else None
            exact_weights = known is None or known(scored.group)
            if replay is not None and replay.missed and not exact_weights:
                self.counters["draw_misses_unknown"] += 1
                replay = None
            if replay is not None and replay.missed:
                judged[sender] = None
                self.counters["draw_strikes"] += 1
                needed = 1 if replay.gross else self.samples.config.seed_ban_alarms
                if self.reputation.alarmed(sender, needed, "not_drawn"):  # False once banned
                    banned.append(sender)
                    self._banned(
                        sender,
                        "its completions are not the draws of the seeds they carry "
                        f"({replay.worst:.3f} of the probability mass off, tolerance {replay.tolerance})",
                    )
                struck[sender] = f"{replay.missed} completion(s) of a group are not the draws of its seed"
                continue
            if allowance is None:
                continue
            judged[sender] = None
            log_e = repeats[index] if repeats is not None and index < len(repeats) else None
            repeated = log_e is not None and self.samples.observe_repeats(sender, log_e)
            if repeated:
                self.counters["duplicate_strikes"] += 1
                needed = self.samples.config.duplicate_ban_alarms
                if self.reputation.alarmed(sender, needed, "repeated"):  # False once banned
                    banned.append(sender)
                    self._banned(
                        sender,
                        f"its groups repeat completions the policy finds unlikely ({needed} alarms of the "
                        "duplicate test)",
                    )
                struck[sender] = "the duplicate test"
                continue
            verdict = self.samples.observe_group(
                sender,
                group_scores,
                allowance,
                None if exact is None or not exact_weights else functools.partial(exact, index),
            )
            if verdict == "withdrawn":
                self.counters["tail_alarms_withdrawn"] += 1  # the policy's move, not the sender's
            elif verdict != "clean":
                exactly = verdict == "exact_alarm"
                struck[sender] = "the tail test, " + (
                    "its group scored under the version it claims"
                    if exactly
                    else f"{allowance:.3f} nats of the policy's drift forgiven"
                )
                self.counters["tail_strikes_exact" if exactly else "tail_strikes"] += 1
        for sender in judged:
            if sender in struck:
                self.counters["not_sampled_strikes"] += 1
                logger.info(
                    "strike against %s: its completions are unlikely samples of the policy (%s)",
                    sender,
                    struck[sender],
                )
            if self.reputation.judged(sender, sender in struck, "not_sampled"):  # False once banned
                banned.append(sender)
                self._banned(sender, "its completions are not samples of the policy")
        return banned

    def share(self, directory, ttl: float) -> None:
        """Publish this trainer's bans (when they changed) and adopt those of the run's trusted trainers."""
        bans = self.reputation.bans()
        current = tuple(sorted(bans))
        if bans and current != self._published:
            record = BanRecord(
                peer_id=self.peer_id,
                bans=[
                    Ban(peer_id=p, until=until, reason=reason)
                    for p, (until, reason) in sorted(bans.items(), key=lambda kv: -kv[1][0])[:256]
                ],
            )
            if directory.announce_bans(record, ttl):
                self._published = current
        if self.trust is None or not self.trust.configured:
            return
        for entry in directory.ban_records():
            record = entry.record
            if record.peer_id == self.peer_id or not self.trust.is_trusted(record.peer_id):
                continue
            for ban in record.bans:
                if ban.peer_id != self.peer_id and self.reputation.ban(ban.peer_id, ban.until, ban.reason):
                    self.counters["bans_adopted"] += 1
                    self._drop(ban.peer_id, "adopted a ban")

    def _banned(self, sender: str, why: str) -> None:
        """``sender`` was just banned by this trainer's own check: say why, drop its buffered groups."""
        self._drop(sender, "banned")
        logger.warning("banned %s: %s", sender, why)

    def _drop(self, sender: str, why: str) -> None:
        if self.buffer is not None:
            dropped = self.buffer.drop_sender(sender)
            self.counters["groups_dropped_banned"] += dropped
            logger.info("%s %s: dropped its %d buffered groups", why, sender, dropped)

    def stats(self) -> dict[str, Any]:
        return {
            "groups_checked": self.reputation.checked,
            "groups_over_gap": self.reputation.failed,
            "banned": len(self.reputation.bans()),
            **dict(self.counters),
        }
