"""The sender's book of trainers: what each trainer asked this inference peer for, and which group is owed to
which trainer.

Owned here: ``TrainerState`` (one trainer as the sender sees it: its room, back-off, grant, delivery counters)
and ``GrantLedger`` (the trainers by peer id, and the ownership of groups). A trainer that paces
(``train.pacing``) grants this peer a number of groups in every ack (``PushAck.wanted``). ``take`` reserves
grants for the sampling thread, largest first, and each group that thread then submits belongs to the trainer
whose grant it took (``claim``). The groups owed to a trainer (being sampled, waiting in the outbox, in flight
to it) come off that trainer's next grant and no other's (``grant_from_ack``). A group that loses its owner
(the owner refused it for now, failed, or left the directory) takes the next grant any trainer holds for
this peer before anything new is sampled for it (``adopt``); ``take_batch`` gives the next push: the waiting
groups of one owner. Pure bookkeeping, not thread-safe: the pusher (``rollouts.push``) calls it under its
lock.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar


@dataclass
class TrainerState:
    peer_id: str
    maddrs: list[str]
    room: int
    stamp: float  # wall-clock time the room figure is from
    bad_until: float = 0.0  # monotonic
    failures: int = 0  # failed pushes in a row (the back-off grows with them)
    recheck_at: float = float("inf")  # monotonic: when a trainer that said "full" is probed again
    # its grant to this peer, less what was reserved since (-1: not paced; None: unknown)
    wanted: int | None = None
    owed: int = 0  # groups sampled or being sampled under its grants and not yet settled with it
    asked_at: float = -float("inf")  # monotonic: when its last ack (push or room query) arrived
    max_staleness: int | None = None  # as its record says
    #: what went to and came from it: granted (groups reserved from its grants), sent, acked, refused
    #: (groups it refused as buffer_full / not_granted / future_version), failed (pushes and queries)
    flow: Counter[str] = field(default_factory=Counter)

    def usable(self, now: float) -> bool:
        """Not in a back-off after failed pushes."""
        return self.bad_until <= now


class Owned(Protocol):
    """A group waiting to be pushed, as the ledger sees it: the trainer it is owed to, if any."""

    owner: str | None


Item = TypeVar("Item", bound=Owned)


class GrantLedger:
    """The trainers a sender pushes to (``trainers``, replaced by each directory read) and which groups are
    owed to which of them (see the module doc)."""

    def __init__(self) -> None:
        self.trainers: dict[str, TrainerState] = {}
        #: per sampling thread: the owners of the groups its last ``take`` reserved, one entry per group
        self._reservations: dict[int, deque[str]] = {}

    # ---- the sampling thread ------------------------------------------------------------------------------
    def take(self, groups: int, now: float) -> int:
        """Reserve up to ``groups`` of the trainers' grants, largest first; the groups the calling thread
        submits next belong to the trainers whose grants they took (``claim``). A trainer that does not pace
        (``wanted`` -1) takes whatever is sampled: ``groups``, owned by nobody."""
        trainers = [t for t in self.trainers.values() if t.usable(now)]
        if any(t.wanted == -1 for t in trainers):
            return groups
        taken = 0
        owners = self._reservations.setdefault(threading.get_ident(), deque())
        for trainer in sorted(trainers, key=lambda t: -(t.wanted or 0)):
            share = min(groups - taken, max(0, trainer.wanted or 0))
            if share <= 0:
                break
            self._own(trainer, share)
            owners.extend([trainer.peer_id] * share)
            taken += share
        return taken

    def release_unclaimed(self) -> None:
        """Groups the calling thread reserved and never submitted (its sampling failed) are not on their
        way: they come off what their trainers are owed."""
        for peer_id in self._reservations.pop(threading.get_ident(), ()):
            self.disown_from(peer_id)

    def claim(self) -> str | None:
        """The owner of the next group the calling thread submits (None: sampled for a trainer that does not
        pace, or not reserved)."""
        owners = self._reservations.get(threading.get_ident())
        return owners.popleft() if owners else None

    # ---- the sender thread --------------------------------------------------------------------------------
    def disown_from(self, peer_id: str | None) -> None:
        """One group owed to ``peer_id`` is settled with it, or no longer goes there."""
        trainer = self.trainers.get(peer_id) if peer_id is not None else None
        if trainer is not None:
            trainer.owed = max(0, trainer.owed - 1)

    def disown(self, item: Owned) -> None:
        self.disown_from(item.owner)
        item.owner = None

    def adopt(self, pending: Iterable[Owned], now: float) -> None:
        """A waiting group whose owner is gone or backing off, or that has none, takes a grant some trainer
        holds for this peer, largest first (nothing more is sampled for that grant), or stays unowned."""
        for item in pending:
            owner = self.trainers.get(item.owner) if item.owner is not None else None
            if owner is not None and owner.usable(now):
                continue
            self.disown(item)
            granting = [t for t in self.trainers.values() if t.usable(now) and (t.wanted or 0) > 0]
            if granting:
                trainer = max(granting, key=lambda t: t.wanted or 0)
                self._own(trainer, 1)
                item.owner = trainer.peer_id

    def take_batch(
        self, pending: deque[Item], most: int
    ) -> tuple[TrainerState, list[Item], deque[Item]] | None:
        """The next push: the owner of the oldest waiting group that has one, with its waiting groups (at most
        ``most``, and at most its room but one at least), and the groups left waiting; None when no waiting
        group has an owner."""
        owner = next((item.owner for item in pending if item.owner is not None), None)
        trainer = self.trainers.get(owner) if owner is not None else None
        if trainer is None:
            return None
        size = min(most, max(1, trainer.room))
        batch: list[Item] = []
        rest: deque[Item] = deque()
        for item in pending:
            (batch if item.owner == owner and len(batch) < size else rest).append(item)
        return trainer, batch, rest

    def grant_from_ack(self, trainer: TrainerState, wanted: int) -> None:
        """``trainer``'s ack granted this peer ``wanted`` groups from now on (-1: it does not pace): what is
        already owed to it is on its way and comes off."""
        wanted = max(-1, wanted)
        trainer.wanted = wanted if wanted < 0 else max(0, wanted - trainer.owed)

    def paced(self) -> bool:
        """Some trainer has said it paces (a grant, 0 included): a room query can ask it for groups."""
        return any(t.wanted is not None and t.wanted >= 0 for t in self.trainers.values())

    # ---- internals ----------------------------------------------------------------------------------------
    @staticmethod
    def _own(trainer: TrainerState, groups: int) -> None:
        trainer.wanted = max(0, trainer.wanted or 0) - groups
        trainer.owed += groups
        trainer.flow["granted"] += groups
