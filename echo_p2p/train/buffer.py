"""Replay buffer and staleness policy of a trainer peer.

Owned here: ``ReplayBuffer``, holding ``train.scored.ScoredGroup`` items: de-duplication by ``rollout_id``,
bounded memory, the staleness rule, reuse counting and the stats a trainer logs and announces (``free_room``).
Called by the trainer peer: its ingest thread calls ``add``; its training loop calls ``take``.
Must not import torch or hivemind (the ingest path stays pure Python) and must not validate or re-score
rollouts (the trainer does that before ``add``): every ``ScoredGroup`` that gets here is trusted.

Staleness policy
----------------
``staleness = current_version - group.policy_version``. ``take`` hands out only groups with
``staleness <= max_staleness`` (``max_staleness=0`` is the sync mode: on-policy only), oldest first
(lowest ``policy_version``, then arrival order): the groups closest to expiring are used before they
expire. Staler groups met on the way are dropped and counted in ``dropped_stale``. A group is handed out
``reuse`` times (default once) and never twice in the same batch. When the buffer is full, ``add`` evicts
the oldest group (same order) and counts it in ``evicted``; an incoming group older than everything in a
full buffer is itself the one evicted. A ``rollout_id`` seen within the last ``seen_ids_window`` ids is a
duplicate and is refused.

Capacity (AReaL-style)
----------------------
A trainer consumes ``B`` groups per policy version (``B / reuse`` new ones), and a group stays usable for
``max_staleness + 1`` versions, so at most ``ceil(B / reuse) * (max_staleness + 1)`` groups can ever be useful
at once; anything above that is bound to expire unused (wasted inference). On top of it comes the slack of
pushes already in flight when the buffer announced its room: ``N`` inference peers that push up to ``k``
groups each. Hence::

    capacity = ceil(B / reuse) * (max_staleness + 1) + N * k        (see ``recommended_capacity``)

With several trainers sharing the inference swarm, ``N`` is the number of peers that may push to this
trainer: the trainer counts the senders whose groups it accepted recently and calls ``resize`` (a resize
never drops a group). ``free_room()`` is the back-pressure signal: inference peers push to a trainer with
room and pause (or sample more slowly) when no trainer has any, instead of producing rollouts that would
expire.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Literal

from echo_p2p.train.scored import ScoredGroup

if TYPE_CHECKING:
    from echo_p2p.train.journal import IntakeJournal


class AddResult(str, Enum):
    """Outcome of ``ReplayBuffer.add``; truthy only for ``ADDED``."""

    ADDED = "added"
    DUPLICATE = "duplicate"  # rollout_id seen within the de-duplication window
    STALE = "stale"  # already older than max_staleness at arrival (needs current_version)
    EVICTED = "evicted"  # the buffer was full and this group was the oldest of all

    def __bool__(self) -> bool:
        return self is AddResult.ADDED


@dataclass
class BufferStats:
    """A snapshot of the buffer's counters (all counts are groups)."""

    size: int
    capacity: int
    free_room: int
    per_version: dict[int, int]
    added: int
    duplicates: int
    dropped_stale: int
    evicted: int
    taken: int
    taken_staleness: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def recommended_capacity(
    batch_groups: int,
    max_staleness: int,
    num_inference_peers: int,
    groups_per_push: int = 1,
    reuse: int = 1,
) -> int:
    """``ceil(batch_groups / reuse) * (max_staleness + 1) + num_inference_peers * groups_per_push``."""
    if batch_groups < 1 or max_staleness < 0 or num_inference_peers < 0 or groups_per_push < 0 or reuse < 1:
        raise ValueError("invalid capacity parameters")
    return math.ceil(batch_groups / reuse) * (max_staleness + 1) + num_inference_peers * groups_per_push


@dataclass(order=True)
class _Entry:
    version: int
    seq: int
    uses_left: int = field(compare=False)
    scored: ScoredGroup = field(compare=False)


class ReplayBuffer:
    """Bounded, thread-safe replay buffer of ``ScoredGroup`` with a max-staleness rule (see module doc).

    :param capacity: most groups held at once (see ``recommended_capacity``)
    :param max_staleness: a group is usable while ``current_version - policy_version <= max_staleness``
    :param reuse: how many times each group is handed out by ``take`` (1: each rollout used once)
    :param seen_ids_window: how many recent ``rollout_id`` values are remembered for de-duplication
        (an LRU; default ``max(16 * capacity, 4096)``)
    :param order: which usable groups ``take`` hands out first: ``"oldest"`` (AReaL's choice: wastes the
        fewest rollouts when producers are slower than the trainer) or ``"newest"`` (least stale: better
        updates when producers are faster and stale groups would be dropped anyway). Eviction when full is
        always oldest first.
    :param journal: an ``IntakeJournal`` that keeps every added group on disk until it is settled: the
        buffer records each group it adds (before ``add`` returns, so before the sender's acknowledgement)
        and settles each one it evicts, drops as stale or drops with its sender; groups handed out by
        ``take`` are settled by the trainer once used.
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        reuse: int = 1,
        seen_ids_window: int | None = None,
        order: Literal["oldest", "newest"] = "oldest",
        journal: IntakeJournal | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if reuse < 1:
            raise ValueError("reuse must be >= 1")
        if order not in ("oldest", "newest"):
            raise ValueError("order must be 'oldest' or 'newest'")
        self.order = order
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.reuse = reuse
        self._seen_follows_capacity = seen_ids_window is None
        self.seen_ids_window = seen_ids_window if seen_ids_window is not None else max(16 * capacity, 4096)
        if self.seen_ids_window < 1:
            raise ValueError("seen_ids_window must be >= 1")
        self._heap: list[_Entry] = []  # min-heap on (policy_version, arrival seq): oldest first
        self._seq = itertools.count()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._per_version: Counter[int] = Counter()
        self._per_sender: Counter[str] = Counter()  # held groups by ``group.sampler_peer_id``
        self._taken_staleness: Counter[int] = Counter()
        self._added = self._duplicates = self._dropped_stale = self._evicted = self._taken = 0
        self._cond = threading.Condition(threading.Lock())
        self.journal = journal

    # ---- ingest side -------------------------------------------------------------------------------------
    def add(
        self, scored: ScoredGroup, current_version: int | None = None, sender_share: int | None = None
    ) -> AddResult:
        """Insert a trusted group. With ``current_version``, a group already too stale is refused at once.

        With ``sender_share``, a full buffer makes room for a sender (``group.sampler_peer_id``) holding
        less than its share by evicting the oldest entry of the sender holding the most, if that one holds
        more than its share: under contention nobody keeps more than its share.
        Returns ``AddResult.ADDED`` (truthy) or the reason it was refused. A refused group still counts as
        seen, so a resend of the same ``rollout_id`` is a duplicate.
        """
        with self._cond:
            rid = scored.rollout_id
            if rid in self._seen:
                self._seen.move_to_end(rid)
                self._duplicates += 1
                return AddResult.DUPLICATE
            self._seen[rid] = None
            if len(self._seen) > self.seen_ids_window:
                self._seen.popitem(last=False)
            if current_version is not None and self._is_stale(scored.policy_version, current_version):
                self._dropped_stale += 1
                return AddResult.STALE
            entry = _Entry(scored.policy_version, next(self._seq), self.reuse, scored)
            if sender_share is not None and len(self._heap) >= self.capacity:
                self._make_room_for(scored.group.sampler_peer_id, sender_share)
            if len(self._heap) >= self.capacity:
                if entry < self._heap[0]:
                    self._evicted += 1
                    return AddResult.EVICTED
                self._settle([self._pop_oldest()])
                self._evicted += 1
            if self.journal is not None:
                self.journal.added(scored)
            self._push(entry)
            self._added += 1
            self._cond.notify_all()
            return AddResult.ADDED

    # ---- training side -----------------------------------------------------------------------------------
    def take(
        self, batch_groups: int, current_version: int, timeout: float | None = None
    ) -> list[ScoredGroup]:
        """Hand out up to ``batch_groups`` usable groups, oldest first, dropping stale ones on the way.

        With ``timeout`` (seconds), first wait until ``batch_groups`` usable groups are there or the time is
        up; either way return what is usable (possibly fewer, possibly none). Each group appears at most once
        per call; a group with uses left goes back in the buffer behind groups of its own version.
        """
        if batch_groups < 0:
            raise ValueError("batch_groups must be >= 0")
        with self._cond:
            if timeout is not None and timeout > 0:
                deadline = time.monotonic() + timeout
                while self._num_usable(current_version) < batch_groups:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            self._drop_stale_locked(current_version)
            out: list[_Entry] = []
            if self.order == "newest":
                out = self._pop_newest(batch_groups)
            while self._heap and len(out) < batch_groups:
                out.append(self._pop_oldest())
            for entry in out:
                self._taken += 1
                self._taken_staleness[current_version - entry.version] += 1
                entry.uses_left -= 1
                if entry.uses_left > 0:
                    self._push(_Entry(entry.version, next(self._seq), entry.uses_left, entry.scored))
            return [entry.scored for entry in out]

    def drop_stale(self, current_version: int) -> int:
        """Drop every group too stale for ``current_version`` now (e.g. when the version advances)."""
        with self._cond:
            return self._drop_stale_locked(current_version)

    def num_usable(self, current_version: int) -> int:
        """How many groups ``take`` could hand out at ``current_version`` (each counted once)."""
        with self._cond:
            return self._num_usable(current_version)

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` groups from now on (the trainer sizes it by the senders it sees).

        A resize never drops a group: a buffer holding more than its new capacity keeps them, has no free
        room, and evicts one for each one added until training has taken it below. A default
        ``seen_ids_window`` grows with the capacity (and never shrinks: no id is forgotten early).
        """
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        with self._cond:
            self.capacity = capacity
            if self._seen_follows_capacity:
                self.seen_ids_window = max(self.seen_ids_window, 16 * capacity)

    # ---- announcements and stats -------------------------------------------------------------------------
    def free_room(self) -> int:
        """Groups that can be added before anything is evicted (trainers announce it on the DHT)."""
        with self._cond:
            return max(0, self.capacity - len(self._heap))

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def peek_size(self) -> int:
        """``len(self)`` without the lock: a moment's view for a watchdog, which must never wait on the
        lock of what it watches (``roles.watchdog``)."""
        return len(self._heap)

    def drop_sender(self, sender: str) -> int:
        """Remove every group ``sender`` sampled (a banned sender); returns how many."""
        with self._cond:
            kept = [e for e in self._heap if e.scored.group.sampler_peer_id != sender]
            dropped = [e for e in self._heap if e.scored.group.sampler_peer_id == sender]
            for entry in dropped:
                self._forget(entry)
            self._settle(dropped)
            self._heap = kept
            heapq.heapify(self._heap)
            return len(dropped)

    def can_make_room_for(self, sender: str, share: int) -> bool:
        """Whether ``add(..., sender_share=share)`` of a group of ``sender`` would make room in a full buffer."""
        with self._cond:
            return self._victim_of(sender, share) is not None

    def held_by(self, sender: str) -> int:
        """Groups in the buffer that ``sender`` sampled (``group.sampler_peer_id``, set by the ingest)."""
        with self._cond:
            return self._per_sender.get(sender, 0)

    def stats(self) -> BufferStats:
        with self._cond:
            return BufferStats(
                size=len(self._heap),
                capacity=self.capacity,
                free_room=max(0, self.capacity - len(self._heap)),
                per_version=dict(sorted(self._per_version.items())),
                added=self._added,
                duplicates=self._duplicates,
                dropped_stale=self._dropped_stale,
                evicted=self._evicted,
                taken=self._taken,
                taken_staleness=dict(sorted(self._taken_staleness.items())),
            )

    # ---- internals (caller holds the lock) ---------------------------------------------------------------
    def _is_stale(self, policy_version: int, current_version: int) -> bool:
        return current_version - policy_version > self.max_staleness

    def _push(self, entry: _Entry) -> None:
        heapq.heappush(self._heap, entry)
        self._per_version[entry.version] += 1
        self._per_sender[entry.scored.group.sampler_peer_id] += 1

    def _forget(self, entry: _Entry) -> None:
        self._per_version[entry.version] -= 1
        if self._per_version[entry.version] == 0:
            del self._per_version[entry.version]
        sender = entry.scored.group.sampler_peer_id
        self._per_sender[sender] -= 1
        if self._per_sender[sender] == 0:
            del self._per_sender[sender]

    def _victim_of(self, sender: str, share: int) -> str | None:
        """The sender that a full buffer evicts from to make room for ``sender``, if any: ``sender`` holds
        less than ``share`` and the sender holding the most holds more."""
        if self._per_sender.get(sender, 0) >= share or not self._per_sender:
            return None
        biggest, held = max(self._per_sender.items(), key=lambda kv: kv[1])
        return biggest if held > share else None

    def _make_room_for(self, sender: str, share: int) -> None:
        biggest = self._victim_of(sender, share)
        if biggest is None:
            return
        victim = min(e for e in self._heap if e.scored.group.sampler_peer_id == biggest)
        self._heap.remove(victim)
        heapq.heapify(self._heap)
        self._forget(victim)
        self._settle([victim])
        self._evicted += 1

    def _pop_oldest(self) -> _Entry:
        entry = heapq.heappop(self._heap)
        self._forget(entry)
        return entry

    def _pop_newest(self, k: int) -> list[_Entry]:
        """The ``k`` freshest entries (highest version, latest arrival), removed; O(n) on a small buffer."""
        chosen = heapq.nlargest(k, self._heap)
        picked = {id(e) for e in chosen}
        self._heap = [e for e in self._heap if id(e) not in picked]
        heapq.heapify(self._heap)
        for entry in chosen:
            self._forget(entry)
        return chosen

    def _drop_stale_locked(self, current_version: int) -> int:
        dropped = []
        while self._heap and self._is_stale(self._heap[0].version, current_version):
            dropped.append(self._pop_oldest())
        self._settle(dropped)
        self._dropped_stale += len(dropped)
        return len(dropped)

    def _settle(self, entries: list[_Entry]) -> None:
        """These entries left the buffer unused, for good: the journal need not keep them."""
        if self.journal is not None and entries:
            self.journal.settled(e.scored.rollout_id for e in entries)

    def _num_usable(self, current_version: int) -> int:
        oldest_ok = current_version - self.max_staleness
        return sum(n for v, n in self._per_version.items() if v >= oldest_ok)
