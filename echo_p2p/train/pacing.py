"""Pacing of the async inference swarm: how many rollout groups a trainer asks each sender to sample now.

Owned here: ``PacingConfig`` and ``Pacer``. The trainer's ingest servicer asks the pacer for a *grant* each
time it answers a sender (a push's ack, or a room query: an empty push), and the sender samples no more
than its grants (``rollouts.push.RolloutPusher.reserve``). Pure Python, thread-safe, no I/O.

What is worth sampling
----------------------
A trainer takes ``B`` groups per version and trains only on groups at most ``S`` (``max_staleness``)
versions old. A group reaches the buffer ``a`` versions old already (sampling, weight propagation and the
push take time; ``a`` is measured, an average over accepted groups), and with ``D`` groups buffered ahead of
it (oldest first) it waits about ``D / B - 1`` more versions. So it is trained on only if
``a + D / B - 1 <= S``, and the trainer never waits only if a whole batch is there when it asks. The pacer
aims at::

    D = B * min(target_steps, max(1, S + 1 - a))

(``target_steps`` batches, 2 by default: the batch the trainer takes next and the one being sampled), and
grants what is missing: ``D - usable - outstanding grants``, each sender at most an equal part of
``D - usable``. Anything above that would age in the buffer
until it is dropped as stale: the electricity of whoever sampled it, wasted.

Fair shares and strangers
-------------------------
The missing groups are split among the senders seen within ``sender_window``; a sender's new grant
replaces its previous one (one outstanding grant per sender), and a grant not delivered within
``grant_seconds`` is void. A sender none of whose groups was accepted yet is granted at most
``newcomer_grant`` groups, and all such senders together at most half of ``D``: a stranger who takes grants
and never delivers holds back a small, expiring part of the room, never all of it.

Deliveries are charged
----------------------
The ingest charges every group that passes validation to its sender (``charge``), useless ones included
(``no_signal``, ``duplicate_content``): first against the sender's grant, then against an allowance for
groups nobody asked for (a grant that expired while the group was sampled, a group granted by another
trainer): ``newcomer_grant`` groups per sender per ``grant_seconds``, and all senders together half of
``D`` per ``grant_seconds``. Beyond both the group is refused (``not_granted``, retryable: an honest pusher
keeps it and resends it once it holds a grant). So a sender that pushes without asking cannot fill the
buffer ahead of the senders the trainer asked: it gets at most ``newcomer_grant`` groups per
``grant_seconds``, and any number of such keys together at most ``D / 2`` per ``grant_seconds``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class PacingConfig(BaseModel):
    """How a trainer paces the inference peers that push to it (async mode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=True,
        description="Grant senders only what will be trained on within max_staleness (off: every ack says "
        "'not paced' and samplers sample as fast as they can, bounded by the buffer's room)",
    )
    target_steps: float = Field(
        default=2.0,
        ge=1.0,
        le=64.0,
        description="Batches the buffer aims to hold (fewer when rollouts arrive staler: see train/pacing.py)",
    )
    grant_seconds: float = Field(
        default=10.0, gt=0, le=600, description="Seconds a grant stays reserved for its sender"
    )
    newcomer_grant: int = Field(
        default=4, ge=1, le=4096, description="Most groups granted at once to a sender with none accepted yet"
    )
    sender_window: float = Field(
        default=5.0, gt=0, le=600, description="Seconds a sender counts in the split after it last asked"
    )
    query_wait: float = Field(
        default=1.0,
        ge=0,
        le=10,
        description="Seconds a room query (an empty push) is held until the trainer wants groups from it",
    )
    max_senders: int = Field(
        default=4096, ge=1, description="Senders tracked at once (least recent forgotten)"
    )


@dataclass
class _Grant:
    groups: int
    at: float  # monotonic
    proven: bool


@dataclass
class _Allowance:
    used: int
    since: float  # monotonic start of the current ``grant_seconds`` window


class Pacer:
    """Grants of a trainer to its senders (see the module doc). ``batch_groups`` is ``B``, the groups one
    update takes; ``max_staleness`` is ``S``."""

    #: weight of the newest arrival in the running mean of arrival staleness
    SMOOTHING = 0.05

    def __init__(self, config: PacingConfig, batch_groups: int, max_staleness: int) -> None:
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError("batch_groups must be >= 1 and max_staleness >= 0")
        self.config = config
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.arrival_staleness = 0.0  # running mean, versions
        self._observed = 0
        self._grants: OrderedDict[str, _Grant] = OrderedDict()
        self._seen: OrderedDict[str, float] = OrderedDict()  # sender -> monotonic time it last asked
        self.granted = 0  # groups granted in all
        self.queries_waited = 0
        self.ungranted = 0  # groups charged beyond their sender's grant (within the allowance)
        self.refused = 0  # groups refused beyond the grant and the allowance (not_granted)
        self._allowances: OrderedDict[str, _Allowance] = OrderedDict()
        self._pool = _Allowance(0, -math.inf)  # all senders' ungranted groups together
        self._lock = threading.Lock()

    # ---- inputs ------------------------------------------------------------------------------------------
    def observe(self, staleness: int) -> None:
        """An accepted group arrived ``staleness`` versions old."""
        staleness = max(0, min(int(staleness), self.max_staleness + 1))
        with self._lock:
            self._observed += 1
            weight = max(self.SMOOTHING, 1.0 / self._observed)  # a plain mean until there are enough
            self.arrival_staleness += weight * (staleness - self.arrival_staleness)

    # ---- outputs -----------------------------------------------------------------------------------------
    def target(self) -> int:
        """``D``: the groups the buffer should hold (see the module doc)."""
        with self._lock:
            return self._target()

    def grant(self, sender: str, usable: int, proven: bool, now: float | None = None) -> int:
        """Groups ``sender`` may sample now (its new grant, replacing its previous one), given ``usable``
        groups in the buffer; ``proven``: some group of this sender was accepted before."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        with self._lock:
            self._expire(now)
            self._seen[sender] = now
            self._seen.move_to_end(sender)
            while len(self._seen) > cfg.max_senders:
                self._seen.popitem(last=False)
            self._grants.pop(sender, None)
            target = self._target()
            wanted = target - max(0, usable)  # before any grant: what each sender gets a part of
            missing = wanted - sum(g.groups for g in self._grants.values())
            if missing <= 0:
                return 0
            groups = min(missing, math.ceil(wanted / len(self._seen)))
            if not proven:
                newcomers = sum(g.groups for g in self._grants.values() if not g.proven)
                groups = min(groups, cfg.newcomer_grant, max(0, target // 2 - newcomers))
            if groups <= 0:
                return 0
            self._grants[sender] = _Grant(groups, now, proven)
            while len(self._grants) > cfg.max_senders:
                self._grants.popitem(last=False)
            self.granted += groups
            return groups

    def charge(self, sender: str, now: float | None = None) -> bool:
        """One validated group of ``sender`` arrived: take it off the sender's grant, else off the allowance
        for groups nobody asked for (see the module doc). False: beyond both, refuse it (``not_granted``)."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        with self._lock:
            self._expire(now)
            grant = self._grants.get(sender)
            if grant is not None and grant.groups > 0:
                grant.groups -= 1
                if grant.groups == 0:
                    del self._grants[sender]
                return True
            if now - self._pool.since > cfg.grant_seconds:
                self._pool = _Allowance(0, now)
            own = self._allowances.get(sender)
            if own is None or now - own.since > cfg.grant_seconds:
                own = self._allowances[sender] = _Allowance(0, now)
            self._allowances.move_to_end(sender)
            while len(self._allowances) > cfg.max_senders:
                self._allowances.popitem(last=False)
            if own.used >= cfg.newcomer_grant or self._pool.used >= max(1, self._target() // 2):
                self.refused += 1
                return False
            own.used += 1
            self._pool.used += 1
            self.ungranted += 1
            return True

    def outstanding(self, now: float | None = None) -> int:
        """Groups granted and not yet due (delivered groups replace a grant when their sender asks again)."""
        with self._lock:
            self._expire(time.monotonic() if now is None else now)
            return sum(g.groups for g in self._grants.values())

    def stats(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "target": self._target(),
                "arrival_staleness": round(self.arrival_staleness, 3),
                "granted": self.granted,
                "outstanding": sum(g.groups for g in self._grants.values()),
                "senders": len(self._seen),
                "ungranted": self.ungranted,
                "not_granted": self.refused,
            }

    # ---- internals (caller holds the lock) ---------------------------------------------------------------
    def _target(self) -> int:
        steps = min(self.config.target_steps, max(1.0, self.max_staleness + 1 - self.arrival_staleness))
        return max(1, round(self.batch_groups * steps))

    def _expire(self, now: float) -> None:
        for sender in [s for s, g in self._grants.items() if now - g.at > self.config.grant_seconds]:
            del self._grants[sender]
        while self._seen and now - next(iter(self._seen.values())) > self.config.sender_window:
            self._seen.popitem(last=False)
