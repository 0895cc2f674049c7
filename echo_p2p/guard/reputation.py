"""Senders' reputation on a trainer: behaviour log-prob checks, strikes and bans.

A trainer recomputes the log-prob of every token it trains on; a sampler reports the log-prob it sampled
each token with. At the same policy the two agree (to rounding); a stale or quantised sampler differs by a
little; a sampler that makes them up differs by a lot. ``Reputation`` records, per sender, each group's
mean |gap| per token (``Learner.last_group_gaps``): a group above ``max_logprob_gap`` plus its allowance (how
far the trainer's own policy moved since the group's version, ``guard.drift``) is a strike (a completion
above ``exclude_logprob_gap`` plus the allowance was already left out of the loss), ``strikes`` of them
within ``window`` seconds ban the sender for ``ban_seconds`` when they are also at least ``ban_fraction`` of
its last ``recent_groups`` groups (an update can move a few groups' log-probs, those with rare tokens, far
more than the measured movement: an honest sampler has the odd strike, a liar has them on most groups):
its pushes are refused (``banned``) and its groups dropped from the buffer. Bans also arrive from the other
trainers of the run (their signed ``BanRecord``s): one trainer's finding protects them all.

Owned here: ``ReputationConfig`` and ``Reputation`` (thread-safe, bounded memory). No I/O: the trainer peer
feeds it and publishes its bans. Must not import torch or hivemind.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class ReputationConfig(BaseModel):
    """How a trainer judges the behaviour log-probs its senders report."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_logprob_gap: float | None = Field(
        default=2.0,
        gt=0,
        description="Largest mean |behaviour - trainer log-prob| per token (nats) over a group's tokens, on "
        "top of how far the trainer's own policy moved since the group's version (guard.drift); above it the "
        "group is a strike against its sender. Honest fp32, 8-bit and 4-bit samplers up to "
        "max_staleness versions behind stay well below (docs/security.md). None: no strikes.",
    )
    exclude_logprob_gap: float | None = Field(
        default=4.0,
        gt=0,
        description="A completion whose own mean gap per token is above this is left out of the loss (the "
        "learner's ``max_logprob_gap``): short honest completions are noisier than groups. None: none.",
    )
    strikes: int = Field(
        default=3,
        ge=1,
        description="Strikes within ``window`` that ban a sender, when they are also at least ``ban_fraction`` "
        "of its last ``recent_groups`` groups (other checks: ``recent_judgements``)",
    )
    ban_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of a sender's recent groups that must be strikes for a ban: an update can move the "
        "log-probs of a few groups (rare tokens) far more than the policy's measured movement, so an honest "
        "sampler has the odd strike; a liar has them on most of its groups (the sample check: of the training "
        "steps that judged it)",
    )
    recent_groups: int = Field(
        default=100,
        ge=1,
        description="A sender's last groups over which the gap check's ``ban_fraction`` is taken",
    )
    recent_judgements: int = Field(
        default=20,
        ge=1,
        description="The other checks (the sample check judges a sender once per training step that trained on "
        "its groups): its last judgements over which ``ban_fraction`` is taken. Shorter than ``recent_groups``: "
        "an editor looks clean until the policy it edits has learned (docs/security.md), and a long clean "
        "history made it wait for 50 strikes",
    )
    window: float = Field(default=600.0, gt=0, description="Seconds a strike counts")
    ban_seconds: float = Field(default=1800.0, gt=0, le=86400, description="How long a ban lasts")
    max_tracked: int = Field(default=4096, ge=1, description="Senders remembered (least recent forgotten)")


@dataclass
class _Sender:
    # its last judgements, strike or not (a deque ``recent_groups`` or ``recent_judgements`` long)
    recent: deque[bool]
    strikes: deque[float] = field(default_factory=deque)  # wall-clock times of strikes within the window
    checked: int = 0
    failed: int = 0


class Reputation:
    """Per-sender strikes and bans (see the module doc). Times are wall-clock (bans are shared)."""

    def __init__(self, config: ReputationConfig | None = None) -> None:
        self.config = config or ReputationConfig()
        self._senders: OrderedDict[str, _Sender] = OrderedDict()
        self._bans: dict[str, tuple[float, str]] = {}  # peer id -> (until, reason)
        self._others: OrderedDict[str, _Sender] = OrderedDict()  # the other checks' judgements (``judged``)
        self._alarms: OrderedDict[str, deque[float]] = OrderedDict()  # exact tests' alarm times (``alarmed``)
        self._lock = threading.Lock()
        self.checked = 0
        self.failed = 0

    def record(self, sender: str, gap: float, allowance: float = 0.0, now: float | None = None) -> bool:
        """One group of ``sender`` whose mean log-prob gap per token was ``gap``, judged against
        ``max_logprob_gap`` plus ``allowance`` (how far the policy itself moved since the group was sampled:
        ``guard.drift``); True when this bans the sender."""
        limit = self.config.max_logprob_gap
        if not sender or limit is None:
            return False
        now = time.time() if now is None else now
        strike = gap > limit + allowance
        with self._lock:
            self.checked += 1
            self.failed += strike
            return self._judge_locked(
                self._senders, self.config.recent_groups, sender, strike, "logprob_gap", now
            )

    def judged(self, sender: str, struck: bool, reason: str, now: float | None = None) -> bool:
        """One judgement of ``sender`` by another check than the log-prob gap (``reason``, e.g. a training
        step's ``guard.sampling_check`` alarms, which already weighed the sender's recent completions), a
        strike or not; its strikes ban it as the gap check's do (``strikes`` within ``window``, at least
        ``ban_fraction`` of its last ``recent_judgements`` such judgements). True when this bans it."""
        if not sender:
            return False
        now = time.time() if now is None else now
        with self._lock:
            return self._judge_locked(
                self._others, self.config.recent_judgements, sender, struck, reason, now
            )

    def alarmed(self, sender: str, needed: int, reason: str, now: float | None = None) -> bool:
        """An alarm of an exact test against ``sender`` (the duplicate test: an e-value whose false-alarm rate
        holds for every honest sender, with no policy shake to forgive, ``guard.sampling_check``): its
        ``needed``-th such alarm within ``window`` bans it, with no ``ban_fraction`` of clean judgements to
        outweigh first (an editor is clean until the policy answers right). True when this bans it."""
        if not sender:
            return False
        now = time.time() if now is None else now
        with self._lock:
            times = self._alarms.pop(sender, None) or deque()
            self._alarms[sender] = times
            while len(self._alarms) > self.config.max_tracked:
                self._alarms.popitem(last=False)
            times.append(now)
            while times and times[0] < now - self.config.window:
                times.popleft()
            if len(times) < needed or self._banned_locked(sender, now):
                return False
            self._bans[sender] = (now + self.config.ban_seconds, reason[:32])
            return True

    def strike(self, sender: str, reason: str, now: float | None = None) -> bool:
        """A strike against ``sender`` from another check than the log-prob gap: ``judged`` with a strike."""
        return self.judged(sender, True, reason, now)

    def _judge_locked(
        self,
        table: OrderedDict[str, _Sender],
        recent: int,
        sender: str,
        struck: bool,
        reason: str,
        now: float,
    ) -> bool:
        """Record a judgement in ``sender``'s entry of ``table`` (bounded), which keeps its last ``recent``
        judgements, and ban it when its strikes are ``strikes`` within ``window`` and at least
        ``ban_fraction`` of those."""
        stats = table.get(sender)
        if stats is None:
            stats = table[sender] = _Sender(deque(maxlen=recent))
            while len(table) > self.config.max_tracked:
                table.popitem(last=False)
        table.move_to_end(sender)
        stats.checked += 1
        stats.recent.append(struck)
        if not struck:
            return False
        stats.failed += 1
        stats.strikes.append(now)
        while stats.strikes and stats.strikes[0] < now - self.config.window:
            stats.strikes.popleft()
        if len(stats.strikes) < self.config.strikes or self._banned_locked(sender, now):
            return False
        if sum(stats.recent) < self.config.ban_fraction * len(stats.recent):
            return False  # the odd outlier among mostly clean judgements (a policy that moved, not a liar)
        self._bans[sender] = (now + self.config.ban_seconds, reason[:32])
        return True

    def ban(self, sender: str, until: float, reason: str, now: float | None = None) -> bool:
        """Ban ``sender`` until ``until`` (wall clock, capped at ``ban_seconds`` from now); True if new."""
        now = time.time() if now is None else now
        until = min(until, now + self.config.ban_seconds)
        if until <= now:
            return False
        with self._lock:
            new = not self._banned_locked(sender, now)
            if new or until > self._bans[sender][0]:
                self._bans[sender] = (until, reason[:32])
                self._trim(now)
            return new

    def is_banned(self, sender: str, now: float | None = None) -> bool:
        with self._lock:
            return self._banned_locked(sender, time.time() if now is None else now)

    def bans(self, now: float | None = None) -> dict[str, tuple[float, str]]:
        """The bans in force: peer id -> (until, reason)."""
        now = time.time() if now is None else now
        with self._lock:
            self._trim(now)
            return dict(self._bans)

    def sender_stats(self, sender: str) -> tuple[int, int]:
        """``(groups checked, groups above the gap)`` of ``sender``."""
        with self._lock:
            stats = self._senders.get(sender)
            return (stats.checked, stats.failed) if stats else (0, 0)

    def judgement_stats(self, sender: str) -> tuple[int, int]:
        """``(judgements, strikes)`` of ``sender`` by the other checks (``judged``: the sample check)."""
        with self._lock:
            stats = self._others.get(sender)
            return (stats.checked, stats.failed) if stats else (0, 0)

    def _banned_locked(self, sender: str, now: float) -> bool:
        ban = self._bans.get(sender)
        return ban is not None and ban[0] > now

    def _trim(self, now: float) -> None:
        for peer in [p for p, (until, _) in self._bans.items() if until <= now]:
            del self._bans[peer]
        while len(self._bans) > self.config.max_tracked:  # keep the longest bans
            del self._bans[min(self._bans, key=lambda p: self._bans[p][0])]
