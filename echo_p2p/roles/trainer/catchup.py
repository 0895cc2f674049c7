"""A trainer behind the run: when to download the other trainers' state, and when nobody can give it.

Owned here: ``CatchUp``, the trainer peer's policy for catching up while idle (``SyncedOptimizer.catch_up``
through ``CollabTrainerStep``) and for going on alone after the version it is behind was orphaned (its
publisher left while this trainer was behind; ``orphaned_version``, pure). Caller: ``TrainerPeer.work``.
See docs/protocol.md (catch-up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds without a batch after which a trainer behind the other trainers downloads their state (it cannot
#: step: rollouts of versions it has not reached go to other trainers), and the fewest seconds between two
#: attempts; at least 4x the last attempt's duration, so downloads take at most a fifth of the time. (A
#: trainer that waited 2 s, then 5 s, starved: the tiny model moves ~4 versions/s, 30 per wait.)
CATCH_UP_IDLE = 1.0
CATCH_UP_EVERY = 1.0


class CatchUp:
    """Catch-up attempts of one trainer.

    :param stepper: the ``CollabTrainerStep`` (``version``, ``catch_up()``, ``advance_to(version)``)
    :param reached: ``version -> bool``, called when the weights moved to a new version (``TrainerPeer._reached``)
    :param drift: the guard's drift tracker (``record(before, after, None)``: a span whose drift is unknown)
    :param future_refused: how many pushes the ingest refused as ``future_version`` so far (0 in sync mode)
    :param directory: the swarm directory (``trainers()``, ``policies()``), read only after new such refusals
    """

    def __init__(
        self,
        peer_id: str,
        stepper,
        reached: Callable[[int], bool],
        drift,
        directory,
        trust,
        future_refused: Callable[[], int],
        prefix: Callable[[], str] = lambda: "",
    ) -> None:
        self.peer_id, self.stepper, self.reached, self.drift = peer_id, stepper, reached, drift
        self.directory, self.trust, self.future_refused = directory, trust, future_refused
        self.prefix = prefix  # the log prefix, read per line (the version in it moves)
        self.downloads = 0  # state downloads that moved this trainer
        self.went_on_alone = 0  # times it took the version after an orphaned one
        self._next_at = -float("inf")  # monotonic time before which no attempt is made
        self._refused_seen = 0  # future_version refusals when the directory was last read

    def maybe(self, idle_since: float) -> None:
        """Idle for ``CATCH_UP_IDLE`` s while the other trainers are ahead: download their state now;
        nobody samples at a version the publisher has left behind."""
        now = time.monotonic()
        if now - idle_since < CATCH_UP_IDLE or now < self._next_at:
            return
        before = self.stepper.version
        try:
            loaded = self.stepper.catch_up() or self._behind_unseen(before)
        finally:
            ended = time.monotonic()
            self._next_at = ended + max(CATCH_UP_EVERY, 4 * (ended - now))
        if not loaded:
            return
        self.downloads += 1
        after = self.stepper.version
        # the downloaded weights are not ours moved by an update: the drift over the span is unknown
        self.drift.record(before, after, None)
        if self.reached(after):
            logger.info(
                "%s caught up with the other trainers: version %d -> %d", self.prefix(), before, after
            )

    def _behind_unseen(self, before: int) -> bool:
        """The progress records did not show this trainer behind, yet pushes were refused as ``future_version``
        since the last look (samplers hold a newer version than ours): read the directory. A live trusted
        trainer announcing a version above ours: download its state anyway (``catch_up(force=True)``; a
        trainer whose progress reads missed its partner's epoch refused every rollout for minutes while the
        samplers pushed it nothing else). Nobody alive holds it: go on after the orphaned version
        (``orphaned_version``). True when a state was loaded."""
        refused = self.future_refused()
        if refused <= self._refused_seen:
            return False
        self._refused_seen = refused
        try:
            records = [e.record for e in self.directory.trainers()]
            policies = [e.record for e in self.directory.policies()]
        except Exception:  # the DHT did not answer: try again at the next attempt
            return False
        if live_trainer_ahead(self.peer_id, before, records, self.trust):
            logger.info(
                "%s rollouts of versions above %d refused and a live trainer announces one: downloading its state",
                self.prefix(),
                before,
            )
            return self.stepper.catch_up(force=True)
        target = orphaned_version(self.peer_id, before, records, policies, self.trust)
        if target is not None and self.stepper.advance_to(target):
            self.went_on_alone += 1
            self.drift.record(before, target, None)
            logger.warning(
                "%s version %d was published by a trainer that left while this one was at %d: going on as %d",
                self.prefix(), target - 1, before, target,
            )  # fmt: skip
            self.reached(target)
        return False


def _live_trainers(peer_id: str, records, trust) -> list:
    """The running trusted trainers other than ``peer_id`` among ``records`` (``PeerRecord``s)."""
    return [
        r
        for r in records
        if r.role == "trainer"
        and r.state == "running"
        and r.peer_id != peer_id
        and (trust is None or trust.is_trusted(r.peer_id))
    ]


def live_trainer_ahead(peer_id: str, version: int, records, trust) -> bool:
    """Whether a running trusted trainer other than ``peer_id`` announces (``records``) a version above
    ``version``: it can give its state."""
    return any((r.policy_version or 0) > version for r in _live_trainers(peer_id, records, trust))


def orphaned_version(peer_id: str, version: int, records, policies, trust) -> int | None:
    """The version a trainer behind the run should hold from now on when nobody can give it the run's state,
    else None.

    Behind: a trusted trainer published a version above ``version`` (``policies``: ``PolicyRecord``s; inference
    peers sample with it, and this trainer refuses their rollouts as ``future_version``). Nobody can give it
    the state: no running trusted trainer other than ``peer_id`` announces (``records``) a version above
    ``version``, and the publisher of the newest version has no running record any more — the one ahead
    left (SIGKILLed while this one was behind; its record expired). Then the trainer goes on from its
    own weights as the version *after* the newest published one: a number never published with other
    weights, which inference peers take as newer, and their rollouts of the old version stay usable."""
    trusted = lambda p: trust is None or trust.is_trusted(p)  # noqa: E731
    newest = max((r for r in policies if trusted(r.peer_id)), key=lambda r: r.version, default=None)
    if newest is None or newest.version <= version:
        return None
    for r in _live_trainers(peer_id, records, trust):
        if r.peer_id == newest.peer_id or (r.policy_version or 0) > version:
            return None  # it is alive (its record may only be a heartbeat old): catching up will do
    return newest.version + 1
