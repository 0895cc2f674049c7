"""Inference side of the async push (``--mode async``): deliver sampled rollout groups to trainers.

Owned here: ``RolloutPusher``, a bounded outbox that ``submit`` fills (blocking while it is full: memory stays
bounded, sampling waits) and a sender thread that pushes batches to trainers, keeps every group until a
trainer acknowledges it, and resends it after an error or a timeout (that trainer is skipped for a growing
back-off). Acks report the trainer's policy version (``trainer_version``, ``on_trainer_version``) and
too-stale refusals raise ``stale_floor``, so the peer can stop sampling with a version nobody accepts.

Pacing: each ack carries the trainer's grant to this peer (``PushAck.wanted``, see ``train.pacing``), and
``reserve`` hands the sampling thread only groups some trainer asked for, waiting (while the sender thread
holds room queries, pushes of no payload, at the trainers) when none did: nothing is sampled that would age
unused in a buffer. A group belongs to the trainer whose grant it was sampled under and is pushed there; the
groups owed to a trainer come off its next grant and no other's; a group its owner refuses (``not_granted``,
``buffer_full``, ``future_version``) or whose owner fails or leaves takes the next grant any trainer holds for
this peer (``rollouts.grants``). Routing by anything else broke pacing with two trainers: groups granted by
one were pushed to the other, which refused them as not granted, while the first waited out its grants with
an empty buffer and its partner waited for it at the epoch's all-reduce (10 s version stalls in the soak,
``docs/reliability.md``). A trainer not known to pace (``wanted`` -1, or no ack yet) gets what is sampled as
fast as the outbox drains, the one announcing the most free room first; one that answered ``buffer_full`` is
probed again after ``full_recheck``. The receiving side is ``rollouts.ingest.RolloutIngestServicer``.
Delivery is at-least-once: a trainer that dies before acking costs a resend; trainers de-duplicate by id.
Caller: the inference peer. Must not import torch; blocking work never runs in the loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, PeerID

from echo_p2p.logs import RateLimitedLog
from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import MAX_ROLLOUT_ID_LEN, RolloutGroup
from echo_p2p.transport.p2p_loop import P2PLoop, peer_id_of
from echo_p2p.transport.rollouts.config import PusherConfig
from echo_p2p.transport.rollouts.grants import GrantLedger, TrainerState
from echo_p2p.transport.rollouts.ingest import DELIVERED, RolloutIngestServicer, Status
from echo_p2p.transport.rollouts.refusals import RETRYABLE_REASONS, ROUTINE_REASONS, Reason

logger = logging.getLogger(__name__)

#: Seconds between two lines about rollouts refused for the same reason by the same trainer (with a count):
#: a policy at its plateau repeats itself, and each repeat is refused as duplicate_content.
REFUSAL_LOG_PERIOD = 10.0
#: Trainers whose delivery counters a metrics line carries (``stats()['by_trainer']``)
MAX_TRAINERS_REPORTED = 8
ROUTINE = frozenset(r.value for r in ROUTINE_REASONS)


# ---- inference side ---------------------------------------------------------------------------------------
async def push_payloads(
    p2p: P2P, peer_id: PeerID, namespace: str | None, payloads: Iterable[rollouts_pb2.RolloutPayload]
) -> rollouts_pb2.PushAck:
    """One push: ``payloads`` in hivemind's stream framing (what ``rpc_push_rollouts``' stub sends), read the
    ``PushAck`` while writing (a trainer may refuse from a frame's header and answer at once), then close
    the stream *first*. The trainer keeps its end open until then (``RolloutIngestServicer._linger``): a
    stream its receiver closes first can be reset by p2pd, and the reset can overtake the ack. Raises when
    the stream ends without an ack."""
    name = RolloutIngestServicer._get_handle_name(namespace, "rpc_push_rollouts")
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, name)

    async def write() -> None:
        for payload in payloads:
            await P2P.send_protobuf(payload, writer)
        await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

    writing = asyncio.create_task(write())
    try:
        ack, error = await P2P.receive_protobuf(rollouts_pb2.PushAck, reader)
        if error is not None:
            raise RuntimeError(f"the trainer failed the push: {error.message}")
        return ack
    finally:
        writing.cancel()
        writer.close()
        await asyncio.gather(writing, return_exceptions=True)  # its cancellation, not ours, is absorbed


@dataclass
class _Item:
    group: RolloutGroup
    payload: bytes
    attempts: int = 0  # pushes that carried it
    refusals: int = 0  # retryable refusals
    #: the trainer whose grant it was sampled under (it goes there), or None: any trainer that grants it
    owner: str | None = None


class RolloutPusher:
    """Inference side of the async push: a bounded outbox and a sender thread (see the module doc).

    ``directory`` is anything with ``trainers() -> list[Entry[PeerRecord]]`` (a ``SwarmDirectory``). The
    sampling thread calls ``submit``; ``start``/``shutdown`` bracket the sender thread. ``is_trusted``
    (``peer_id -> bool``, e.g. ``RunTrust.is_trusted``): only trainers it accepts are ever pushed to; a peer
    that merely announces ``role: trainer`` gets nothing (counted ``untrusted_trainers_skipped``).
    """

    def __init__(
        self,
        loop: P2PLoop,
        directory,
        config: PusherConfig | None = None,
        namespace: str | None = None,
        is_trusted: Callable[[str], bool] | None = None,
    ) -> None:
        self.loop = loop
        self.is_trusted = is_trusted
        self.directory = directory
        self.config = config or PusherConfig()
        self.namespace = namespace
        self._pending: deque[_Item] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ledger = GrantLedger()  # the trainers, their grants, and which group is owed to which
        self._refreshed_at = -float("inf")
        self.counters: Counter[str] = Counter()  # submitted, sent, acked, duplicates, resent, failed_pushes
        self.rejected: Counter[str] = Counter()  # reason -> groups refused for good
        #: reason -> whole pushes a trainer refused unread (``PushAck.error``: banned, rate_limited, ...)
        self.pushes_refused: Counter[str] = Counter()
        self.banned_by: set[str] = set()  # trainers that refused a push as banned
        self.seconds_waiting_for_room = 0.0  # submit blocked on a full outbox
        self.seconds_without_trainer = 0.0  # groups waiting and no trainer with room
        self.seconds_paced = 0.0  # reserve waited: no trainer wanted more groups
        self._reserving = 0  # sampling threads waiting in reserve (the sender thread queries for room)
        self.trainer_version: int | None = None  # the newest policy version an ack reported
        self.stale_floor: int | None = None  # the newest policy version of a group refused as too stale
        #: called (in the sender thread) with a trainer's version when an ack reports a newer one
        self.on_trainer_version: Callable[[int], None] | None = None
        self._refusals_log = RateLimitedLog(logger, REFUSAL_LOG_PERIOD)  # per (trainer, reason)

    # ---- API of the sampling thread ---------------------------------------------------------------------
    def start(self) -> RolloutPusher:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="echo-rollout-pusher", daemon=True)
            self._thread.start()
        return self

    def submit(
        self,
        groups: Iterable[RolloutGroup],
        timeout: float | None = None,
        stop_event: threading.Event | None = None,
    ) -> int:
        """Queue ``groups`` for delivery; blocks while the outbox is full. Returns how many were handled:
        fewer when ``timeout`` passes, ``stop_event`` is set or the pusher shuts down (the caller keeps the
        rest, from that index on). A group that can never be sent (too large, bad id) is dropped, counted in
        ``rejected`` and counts as handled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        queued = 0
        for group in groups:
            if not group.rollout_id or len(group.rollout_id) > MAX_ROLLOUT_ID_LEN:
                logger.warning("dropping a rollout with an invalid id %r", group.rollout_id[:80])
                with self._cond:
                    self.rejected[Reason.MALFORMED.value] += 1
                    self._ledger.disown_from(self._ledger.claim())
                queued += 1
                continue
            payload = group.to_bytes()
            if len(payload) > self.config.max_group_bytes:
                logger.warning(
                    "dropping rollout %s: %d bytes is too large to send", group.rollout_id, len(payload)
                )
                with self._cond:
                    self.rejected[Reason.TOO_LARGE.value] += 1
                    self._ledger.disown_from(self._ledger.claim())
                queued += 1
                continue
            with self._cond:
                started = time.monotonic()
                while self._held() >= self.config.outbox_groups:
                    if self._stop.is_set() or (stop_event is not None and stop_event.is_set()):
                        break
                    remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                self.seconds_waiting_for_room += time.monotonic() - started
                if self._held() >= self.config.outbox_groups:
                    return queued
                self._pending.append(_Item(group, payload, owner=self._ledger.claim()))
                self.counters["submitted"] += 1
                queued += 1
                self._cond.notify_all()
        return queued

    def reserve(
        self, groups: int, timeout: float | None = None, stop_event: threading.Event | None = None
    ) -> int:
        """How many groups (at most ``groups``) to sample now: what trainers granted this peer and nobody
        reserved yet. Waits while no trainer wants any (the sender thread asks them), at most ``timeout``;
        returns 0 when it passes, ``stop_event`` is set or the pusher shuts down. A trainer that does not pace
        takes whatever is sampled: ``groups``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        started = time.monotonic()
        with self._cond:
            # groups this thread reserved before and never submitted (its sampling failed): not on their way
            self._ledger.release_unclaimed()
            self._reserving += 1
            try:
                while not self._stop.is_set() and not (stop_event is not None and stop_event.is_set()):
                    granted = self._ledger.take(groups, time.monotonic())
                    if granted:
                        return granted
                    remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
                    if remaining <= 0:
                        break
                    self._cond.notify_all()  # the sender thread: someone waits for a grant
                    self._cond.wait(remaining)
                return 0
            finally:
                self._reserving -= 1
                self.seconds_paced += time.monotonic() - started

    def useful_floor(self) -> int | None:
        """The newest policy version too old to sample with now, or None: a group of it would reach the
        trainer (at the version its last ack reported, one more by the time a push lands) already at that
        trainer's ``max_staleness``, with no version left to wait in its buffer."""
        staleness = [
            t.max_staleness for t in list(self._ledger.trainers.values()) if t.max_staleness is not None
        ]
        if self.trainer_version is None or not staleness:
            return None
        return self.trainer_version + 1 - min(staleness)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued group is acknowledged (or dropped); False when ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._held():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def outbox_size(self) -> int:
        with self._cond:
            return self._held()

    def outbox_full(self) -> bool:
        """Whether ``submit`` would wait for room now, read without the lock (for a watchdog, which must
        never wait on the lock of what it watches: ``roles.watchdog``)."""
        return self._held() >= self.config.outbox_groups

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                **{k: self.counters[k] for k in ("submitted", "sent", "acked", "duplicates", "resent")},
                "room_queries": self.counters["room_queries"],
                "seconds_paced": round(self.seconds_paced, 3),
                "failed_pushes": self.counters["failed_pushes"],
                "untrusted_trainers_skipped": self.counters["untrusted_trainers_skipped"],
                "rejected": dict(self.rejected),
                "pushes_refused": dict(self.pushes_refused),
                "banned_by": len(self.banned_by),
                "outbox": self._held(),
                "seconds_waiting_for_room": round(self.seconds_waiting_for_room, 3),
                "seconds_without_trainer": round(self.seconds_without_trainer, 3),
                # per trainer (the last 8 characters of its id), for the few trainers of a run
                "by_trainer": {
                    t.peer_id[-8:]: dict(t.flow)
                    for t in list(self._ledger.trainers.values())[:MAX_TRAINERS_REPORTED]
                },
            }

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the sender thread; groups not yet acknowledged are dropped (their trainers never had them)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- sender thread ----------------------------------------------------------------------------------
    def _held(self) -> int:
        return len(self._pending) + self._in_flight

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception:  # a bug must not silently stop delivery
                logger.exception("rollout pusher step failed")
                self._stop.wait(self.config.idle_wait)

    def _step(self) -> None:
        """One push or room query. A waiting group goes to the trainer whose grant it was sampled under
        (``_Item.owner``); one without an owner takes a grant a trainer holds (``GrantLedger.adopt``), else goes to a
        trainer not known to pace (``_choose``), else waits while a room query asks a trainer for a grant."""
        self._refresh_if_due()
        with self._cond:
            if not self._pending and not self._reserving:
                self._cond.wait(0.2)
                return
            now = time.monotonic()
            self._ledger.adopt(self._pending, now)
            taken = self._ledger.take_batch(self._pending, self.config.batch_groups)
            if taken is not None:
                self._pending = taken[2]
            pending = bool(self._pending)
            pacing = self._ledger.paced()
        if taken is None:
            trainer = self._choose() if pending else None
            if trainer is None:
                if pending and not pacing:
                    self._wait_for_a_trainer()  # nobody with room, and nobody to ask for a grant
                else:
                    self._query_room()
                return
            with self._cond:
                size = min(self.config.batch_groups, len(self._pending), max(1, trainer.room))
                batch = [self._pending.popleft() for _ in range(size)]
        else:
            trainer, batch, _ = taken
        with self._cond:
            self._in_flight += len(batch)
            for item in batch:
                self.counters["resent" if item.attempts else "sent"] += 1
                item.attempts += 1
        trainer.room -= len(batch)
        trainer.flow["sent"] += len(batch)
        requeue: list[_Item] = batch
        try:
            ack = self.loop.run(self._push(trainer, batch), timeout=self.config.push_timeout)
            if ack.error:
                self._refused(trainer, ack.error)
                raise RuntimeError(f"trainer refused the push: {ack.error}")
            requeue = self._settle(trainer, batch, ack)
        except Exception as exc:
            self._failed(trainer)
            logger.info(
                "push of %d groups to %s failed (%s); resending elsewhere", len(batch), trainer.peer_id, exc
            )
        finally:
            with self._cond:
                self._in_flight -= len(batch)
                self._pending.extendleft(reversed(requeue))
                self._cond.notify_all()

    def _wait_for_a_trainer(self) -> None:
        started = time.monotonic()
        self._stop.wait(self.config.idle_wait)
        self.seconds_without_trainer += time.monotonic() - started

    def _refused(self, trainer: TrainerState, error: str) -> None:
        """A trainer refused a whole push: counted by its reason, and a ban said out loud once per trainer (the
        peer's work is wasted there until the ban expires)."""
        reason = error.split(":", 1)[0].strip()[:32] or "unknown"  # the trainer's words: bounded
        self.pushes_refused[reason] += 1
        if reason == "banned" and trainer.peer_id not in self.banned_by:
            self.banned_by.add(trainer.peer_id)
            logger.warning("trainer %s banned this peer: its pushes are refused unread", trainer.peer_id)

    def _failed(self, trainer: TrainerState) -> None:
        self.counters["failed_pushes"] += 1
        trainer.flow["failed"] += 1
        trainer.failures += 1
        trainer.bad_until = time.monotonic() + self.backoff(trainer.failures)
        self.loop.forget(trainer.peer_id)

    def _query_room(self) -> None:
        """The sampling thread waits for a grant: ask the trainer heard from least recently (a push of no
        payload; a pacing trainer answers once it wants groups from us, or after its ``query_wait``)."""
        self._refresh_if_due()
        now = time.monotonic()
        usable = [t for t in self._ledger.trainers.values() if t.bad_until <= now]
        if not usable:
            self._wait_for_a_trainer()
            return
        trainer = min(usable, key=lambda t: t.asked_at)
        try:
            ack = self.loop.run(self._push(trainer, []), timeout=self.config.push_timeout)
            if ack.error:
                raise RuntimeError(f"trainer refused the query: {ack.error}")
            self.counters["room_queries"] += 1
            trainer.flow["queries"] += 1
            self._settle(trainer, [], ack)
        except Exception as exc:
            self._failed(trainer)
            logger.info("room query to %s failed (%s)", trainer.peer_id, exc)
        finally:
            with self._cond:
                self._cond.notify_all()

    async def _push(self, trainer: TrainerState, batch: list[_Item]) -> rollouts_pb2.PushAck:
        await self.loop.dial(trainer.peer_id, trainer.maddrs, timeout=self.config.push_timeout / 2)
        payloads = (
            rollouts_pb2.RolloutPayload(rollout_id=item.group.rollout_id, group=item.payload)
            for item in batch
        )
        return await push_payloads(self.loop.p2p, peer_id_of(trainer.peer_id), self.namespace, payloads)

    def backoff(self, failures: int) -> float:
        """Seconds a trainer is not pushed to after ``failures`` failed pushes in a row: ``first_retry``
        doubling up to ``retry_cooldown`` (one lost push must not idle the only trainer of a run for long)."""
        cfg = self.config
        return min(cfg.retry_cooldown, cfg.first_retry * 2 ** max(0, failures - 1))

    def _settle(self, trainer: TrainerState, batch: list[_Item], ack: rollouts_pb2.PushAck) -> list[_Item]:
        """Count the verdicts of a push; returns the groups to send again."""
        trainer.failures = 0
        if ack.policy_version > (self.trainer_version if self.trainer_version is not None else -1):
            self.trainer_version = int(ack.policy_version)
            if self.on_trainer_version is not None:
                self.on_trainer_version(self.trainer_version)
        if ack.free_room >= 0:
            trainer.room, trainer.stamp = int(ack.free_room), time.time()
        requeue: list[_Item] = []
        unread: set[int] = set()  # id() of the groups the trainer did not read
        for index, item in enumerate(batch):  # verdicts come in the order the groups were sent
            verdict = ack.acks[index] if index < len(ack.acks) else None
            if verdict is not None and verdict.rollout_id != item.group.rollout_id:
                verdict = None
            if verdict is None:  # not read by the trainer (over its per-push limit): send again, to it
                requeue.append(item)
                unread.add(id(item))
            elif verdict.status in DELIVERED:
                self.counters["acked"] += 1
                trainer.flow["acked"] += 1
                if verdict.status == Status.DUPLICATE:
                    self.counters["duplicates"] += 1
            elif verdict.reason in (Reason.BUFFER_FULL.value, Reason.NOT_GRANTED.value):
                # kept until some trainer has room (or grants it), however long
                requeue.append(item)
                trainer.flow[verdict.reason] += 1
                trainer.room, trainer.stamp = 0, time.time()
                # a trainer drains its buffer in well under its heartbeat: probe it again soon with one
                # group (its ack carries the real room) instead of waiting for its next announcement
                trainer.recheck_at = time.monotonic() + self.config.full_recheck
            elif (
                verdict.reason == Reason.FUTURE_VERSION.value and item.refusals + 1 < self.config.max_attempts
            ):
                # this trainer has not reached the group's version (it joined late or fell behind, and is
                # catching up): another trainer takes the group, or this one once it has caught up
                item.refusals += 1
                requeue.append(item)
                trainer.flow[verdict.reason] += 1
                trainer.room, trainer.stamp = 0, time.time()
                trainer.recheck_at = time.monotonic() + self.config.full_recheck
            elif _is_retryable(verdict.reason) and item.refusals + 1 < self.config.max_attempts:
                item.refusals += 1
                requeue.append(item)
            else:
                reason = verdict.reason or "unknown"
                self.rejected[reason] += 1
                trainer.flow["rejected"] += 1
                if reason == Reason.TOO_STALE.value:
                    version = item.group.policy_version
                    self.stale_floor = version if self.stale_floor is None else max(self.stale_floor, version)
                # staleness is routine in async mode (counted, in the metrics); anything else is worth a
                # line, one per trainer and reason every REFUSAL_LOG_PERIOD s with how many it stands for
                self._refusals_log.log(
                    logging.DEBUG if reason in ROUTINE else logging.WARNING,
                    (trainer.peer_id, reason),
                    "trainer %s rejected rollout %s: %s %s",
                    trainer.peer_id,
                    item.group.rollout_id,
                    verdict.reason,
                    verdict.detail,
                )
        with self._cond:
            # a group read by the trainer is settled with it: delivered, refused for good, or (refused for
            # now) free to take another trainer's grant
            for item in batch:
                if id(item) not in unread:
                    self._ledger.disown(item)
            # the grant counts the groups of this push as delivered, not those still being sampled, queued or
            # in flight under its grant: they are on their way, so they come off it
            self._ledger.grant_from_ack(trainer, int(ack.wanted))
            trainer.asked_at = time.monotonic()
        return requeue

    def _choose(self) -> TrainerState | None:
        """Among the trainers not known to pace (``wanted`` -1: they take what is sampled; None: no ack yet),
        the one with the most free room now (random among ties), or None."""
        self._refresh_if_due()
        now = time.monotonic()
        unpaced = [
            t
            for t in self._ledger.trainers.values()
            if (t.wanted is None or t.wanted < 0) and t.bad_until <= now
        ]
        usable = [t for t in unpaced if t.room > 0]
        if not usable:  # nobody announced room: probe a trainer that said "full" a while ago
            usable = [t for t in unpaced if t.recheck_at <= now]
            for t in usable:
                t.recheck_at = now + self.config.full_recheck
            return random.choice(usable) if usable else None
        best = max(t.room for t in usable)
        return random.choice([t for t in usable if t.room == best])

    def _refresh_if_due(self) -> None:
        if time.monotonic() - self._refreshed_at >= self.config.refresh_period:
            self._refresh()

    def _refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        try:
            entries = self.directory.trainers()
        except Exception as exc:
            logger.info("reading the trainer list failed: %s", exc)
            return
        own = self.loop.peer_id if self.loop.p2p is not None else None
        seen: dict[str, TrainerState] = {}
        for entry in entries:
            record = entry.record
            if record.role != "trainer" or record.accepts_rollouts is not True or record.state != "running":
                continue
            if record.peer_id == own or record.peer_id in seen:
                continue
            if self.is_trusted is not None and not self.is_trusted(record.peer_id):
                self.counters["untrusted_trainers_skipped"] += 1  # an impostor: never given rollouts
                continue
            room = record.free_buffer_room if record.free_buffer_room is not None else 1
            known = self._ledger.trainers.get(record.peer_id)
            if known is None:
                known = TrainerState(record.peer_id, list(record.maddrs), room, record.updated_at)
            elif record.updated_at > known.stamp:  # a newer announcement than our last ack from it
                known.room, known.stamp, known.maddrs = room, record.updated_at, list(record.maddrs)
            known.max_staleness = record.max_staleness
            seen[record.peer_id] = known
        with self._cond:
            self._ledger.trainers = seen


def _is_retryable(reason: str) -> bool:
    return reason in {r.value for r in RETRYABLE_REASONS}
