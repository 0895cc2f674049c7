"""Async push of rollouts (``--mode async``): inference peers push groups, trainers validate and acknowledge.

Owned here:
- ``RolloutIngestServicer`` (trainer): ``rpc_push_rollouts`` reads a stream of ``RolloutPayload`` (one group
  each) and answers one ``PushAck`` with a verdict per group. Limits on message size and count are enforced
  on receipt; every group goes through the injected ``validate`` (``IngestValidator``) before
  ``buffer.add``; verdicts carry a ``Reason`` back and are counted per sender. An id already accepted is
  acknowledged as DUPLICATE (delivered), so a sender whose ack was lost stops resending. Never raises.
- ``RolloutPusher`` (inference peer): a bounded outbox that ``submit`` fills (blocking while it is full:
  memory stays bounded, sampling waits) and a sender thread that pushes batches to the trainer announcing
  the most free buffer room, keeps every group until a trainer acknowledges it, and resends it to another
  trainer after an error or a timeout (that trainer is skipped for a cool-down).
Delivery is at-least-once: a trainer that dies before acking costs a resend; trainers de-duplicate by id.
Callers: the trainer and inference peers. Must not import torch; blocking work never runs in the loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind's ServicerBase needs typing's for streams

from hivemind.p2p import P2PContext, ServicerBase

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import RolloutGroup
from echo_p2p.train.buffer import AddResult, ReplayBuffer, ScoredGroup
from echo_p2p.train.ingest import MAX_ROLLOUT_ID_LEN, RETRYABLE_REASONS, Reason, Rejection
from echo_p2p.transport.p2p_loop import P2PLoop, peer_id_of
from echo_p2p.transport.rollout_config import IngestServerConfig, PusherConfig

logger = logging.getLogger(__name__)

Status = rollouts_pb2.GroupAck.Status
DELIVERED = (Status.ACCEPTED, Status.DUPLICATE)


@dataclass
class SenderStats:
    """What one sender (an inference peer, by peer id) pushed to this trainer."""

    accepted: int = 0
    duplicates: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    last_seen: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": dict(self.rejected),
            "last_seen": self.last_seen,
        }


class RolloutIngestServicer(ServicerBase):
    """Trainer side of the async push: validate, add to the buffer, acknowledge (see the module doc).

    :param validate: ``group -> ScoredGroup | Rejection`` (e.g. ``lambda g: validator.validate(g, version())``)
    :param buffer: the trainer's replay buffer (``add`` and ``free_room`` are used)
    :param current_version: the trainer's policy version, passed to ``buffer.add`` and echoed in acks
    """

    def __init__(
        self,
        validate: Callable[[RolloutGroup], ScoredGroup | Rejection],
        buffer: ReplayBuffer,
        config: IngestServerConfig | None = None,
        current_version: Callable[[], int] | None = None,
    ) -> None:
        self.validate = validate
        self.buffer = buffer
        self.config = config or IngestServerConfig()
        self.current_version = current_version
        self.senders: OrderedDict[str, SenderStats] = OrderedDict()
        self.totals = SenderStats()
        self.pushes = 0
        self._accepted_ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        # one worker: validation (tokenizer, verifier) runs off the loop and never concurrently with itself
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="echo-ingest")

    async def rpc_push_rollouts(
        self, requests: AsyncIterator[rollouts_pb2.RolloutPayload], context: P2PContext
    ) -> rollouts_pb2.PushAck:
        try:
            sender = context.remote_id.to_base58()
        except Exception:
            sender = "?"
        messages: list[rollouts_pb2.RolloutPayload] = []
        try:
            async with asyncio.timeout(self.config.stream_timeout):
                async for message in requests:
                    messages.append(message)
                    if len(messages) > self.config.max_groups_per_push:
                        break  # one too many is read so that it can be refused; the rest stays unread
        except TimeoutError:
            logger.info("push from %s: stream not finished in %.0f s", sender, self.config.stream_timeout)
        except Exception as exc:  # a broken stream: answer for what was read
            logger.info("push from %s: stream failed (%s)", sender, exc)
        try:
            loop = asyncio.get_running_loop()
            acks = await loop.run_in_executor(self._worker, self._process, sender, messages)
            return rollouts_pb2.PushAck(
                acks=acks, free_room=self._free_room(), policy_version=self._version()
            )
        except Exception as exc:  # never raise to the caller: it would only see a generic error
            logger.exception("processing a push from %s failed", sender)
            return rollouts_pb2.PushAck(error=f"internal error: {type(exc).__name__}", free_room=-1)

    # ---- stats ------------------------------------------------------------------------------------------
    def sender_stats(self, peer_id: str) -> SenderStats:
        """A copy of ``peer_id``'s counters (zeros if it never pushed)."""
        with self._lock:
            stats = self.senders.get(peer_id, SenderStats())
            return SenderStats(stats.accepted, stats.duplicates, Counter(stats.rejected), stats.last_seen)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "pushes": self.pushes,
                **self.totals.as_dict(),
                "senders": {pid: s.as_dict() for pid, s in self.senders.items()},
            }

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    # ---- internals (worker thread) -------------------------------------------------------------------------
    def _process(
        self, sender: str, messages: list[rollouts_pb2.RolloutPayload]
    ) -> list[rollouts_pb2.GroupAck]:
        with self._lock:
            self.pushes += 1
        acks = []
        for index, message in enumerate(messages):
            status, reason, detail = self._verdict(index, message)
            acks.append(
                rollouts_pb2.GroupAck(
                    rollout_id=message.rollout_id[:128], status=status, reason=reason, detail=detail[:256]
                )
            )
            self._count(sender, status, reason)
        return acks

    def _verdict(self, index: int, message: rollouts_pb2.RolloutPayload) -> tuple[int, str, str]:
        config = self.config
        if index >= config.max_groups_per_push:
            return (
                Status.REJECTED,
                Reason.TOO_MANY.value,
                f"at most {config.max_groups_per_push} groups per push",
            )
        if len(message.group) > config.max_group_bytes:
            return (
                Status.REJECTED,
                Reason.TOO_LARGE.value,
                f"{len(message.group)} bytes > {config.max_group_bytes}",
            )
        try:
            group = RolloutGroup.from_bytes(message.group)
        except ValueError as exc:
            return Status.REJECTED, Reason.MALFORMED.value, str(exc).splitlines()[0][:200]
        if group.rollout_id != message.rollout_id:
            return Status.REJECTED, Reason.MALFORMED.value, "rollout_id differs from the payload's"
        with self._lock:
            if group.rollout_id in self._accepted_ids:
                return Status.DUPLICATE, Reason.DUPLICATE.value, "already accepted"
        if config.refuse_when_full and self.buffer.free_room() <= 0:
            return Status.REJECTED, Reason.BUFFER_FULL.value, "no room in the replay buffer"
        try:
            result = self.validate(group)
        except Exception as exc:  # validate should not raise; if it does, refuse and keep serving
            logger.exception("validate raised")
            return Status.REJECTED, Reason.INTERNAL_ERROR.value, type(exc).__name__
        if isinstance(result, Rejection):
            return Status.REJECTED, result.reason.value, result.detail
        if not isinstance(result, ScoredGroup):
            return Status.REJECTED, Reason.INTERNAL_ERROR.value, "validator returned no verdict"
        added = self.buffer.add(result, self._version() if self.current_version is not None else None)
        if added is AddResult.ADDED or added is AddResult.DUPLICATE:
            self._remember(group.rollout_id)
            if added is AddResult.DUPLICATE:
                return Status.DUPLICATE, Reason.DUPLICATE.value, "already in the buffer"
            return Status.ACCEPTED, "", ""
        if added is AddResult.STALE:
            return Status.REJECTED, Reason.TOO_STALE.value, "too stale for the buffer"
        return Status.REJECTED, Reason.BUFFER_FULL.value, "evicted at once: older than every buffered group"

    def _remember(self, rollout_id: str) -> None:
        with self._lock:
            self._accepted_ids[rollout_id] = None
            while len(self._accepted_ids) > self.config.accepted_ids_window:
                self._accepted_ids.popitem(last=False)

    def _count(self, sender: str, status: int, reason: str) -> None:
        with self._lock:
            stats = self.senders.get(sender)
            if stats is None:
                stats = self.senders[sender] = SenderStats()
                while len(self.senders) > self.config.max_tracked_senders:
                    self.senders.popitem(last=False)
            self.senders.move_to_end(sender)
            stats.last_seen = time.time()
            for target in (stats, self.totals):
                if status == Status.ACCEPTED:
                    target.accepted += 1
                elif status == Status.DUPLICATE:
                    target.duplicates += 1
                    target.rejected[reason] += 1
                else:
                    target.rejected[reason] += 1

    def _free_room(self) -> int:
        try:
            return int(self.buffer.free_room())
        except Exception:
            return -1

    def _version(self) -> int:
        if self.current_version is None:
            return -1
        try:
            return int(self.current_version())
        except Exception:
            return -1


# ---- inference side ---------------------------------------------------------------------------------------
@dataclass
class _Item:
    group: RolloutGroup
    payload: bytes
    attempts: int = 0  # pushes that carried it
    refusals: int = 0  # retryable refusals


@dataclass
class _Trainer:
    peer_id: str
    maddrs: list[str]
    room: int
    stamp: float  # wall-clock time the room figure is from
    bad_until: float = 0.0  # monotonic
    failures: int = 0  # failed pushes in a row (the back-off grows with them)
    recheck_at: float = float("inf")  # monotonic: when a trainer that said "full" is probed again


class RolloutPusher:
    """Inference side of the async push: a bounded outbox and a sender thread (see the module doc).

    ``directory`` is anything with ``peers() -> list[Entry[PeerRecord]]`` (a ``SwarmDirectory``). The
    sampling thread calls ``submit``; ``start``/``shutdown`` bracket the sender thread.
    """

    def __init__(
        self, loop: P2PLoop, directory, config: PusherConfig | None = None, namespace: str | None = None
    ) -> None:
        self.loop = loop
        self.directory = directory
        self.config = config or PusherConfig()
        self.namespace = namespace
        self._pending: deque[_Item] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainers: dict[str, _Trainer] = {}
        self._refreshed_at = -float("inf")
        self.counters: Counter[str] = Counter()  # submitted, sent, acked, duplicates, resent, failed_pushes
        self.rejected: Counter[str] = Counter()  # reason -> groups refused for good
        self.seconds_waiting_for_room = 0.0  # submit blocked on a full outbox
        self.seconds_without_trainer = 0.0  # groups waiting and no trainer with room
        self.trainer_version: int | None = None  # the newest policy version an ack reported
        self.stale_floor: int | None = None  # the newest policy version of a group refused as too stale
        #: called (in the sender thread) with a trainer's version when an ack reports a newer one
        self.on_trainer_version: Callable[[int], None] | None = None

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
                queued += 1
                continue
            payload = group.to_bytes()
            if len(payload) > self.config.max_group_bytes:
                logger.warning(
                    "dropping rollout %s: %d bytes is too large to send", group.rollout_id, len(payload)
                )
                with self._cond:
                    self.rejected[Reason.TOO_LARGE.value] += 1
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
                self._pending.append(_Item(group, payload))
                self.counters["submitted"] += 1
                queued += 1
                self._cond.notify_all()
        return queued

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

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                **{k: self.counters[k] for k in ("submitted", "sent", "acked", "duplicates", "resent")},
                "failed_pushes": self.counters["failed_pushes"],
                "rejected": dict(self.rejected),
                "outbox": self._held(),
                "seconds_waiting_for_room": round(self.seconds_waiting_for_room, 3),
                "seconds_without_trainer": round(self.seconds_without_trainer, 3),
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
        with self._cond:
            if not self._pending:
                self._cond.wait(0.2)
                return
        trainer = self._choose()
        if trainer is None:
            started = time.monotonic()
            self._stop.wait(self.config.idle_wait)
            self.seconds_without_trainer += time.monotonic() - started
            return
        with self._cond:
            size = min(self.config.batch_groups, len(self._pending), max(1, trainer.room))
            batch = [self._pending.popleft() for _ in range(size)]
            self._in_flight += len(batch)
            for item in batch:
                self.counters["resent" if item.attempts else "sent"] += 1
                item.attempts += 1
        trainer.room -= len(batch)
        requeue: list[_Item] = batch
        try:
            ack = self.loop.run(self._push(trainer, batch), timeout=self.config.push_timeout)
            if ack.error:
                raise RuntimeError(f"trainer refused the push: {ack.error}")
            requeue = self._settle(trainer, batch, ack)
        except Exception as exc:
            self.counters["failed_pushes"] += 1
            trainer.failures += 1
            trainer.bad_until = time.monotonic() + self.backoff(trainer.failures)
            self.loop.forget(trainer.peer_id)
            logger.info(
                "push of %d groups to %s failed (%s); resending elsewhere", len(batch), trainer.peer_id, exc
            )
        finally:
            with self._cond:
                self._in_flight -= len(batch)
                self._pending.extendleft(reversed(requeue))
                self._cond.notify_all()

    async def _push(self, trainer: _Trainer, batch: list[_Item]) -> rollouts_pb2.PushAck:
        await self.loop.dial(trainer.peer_id, trainer.maddrs, timeout=self.config.push_timeout / 2)
        stub = RolloutIngestServicer.get_stub(
            self.loop.p2p, peer_id_of(trainer.peer_id), namespace=self.namespace
        )

        async def messages() -> AsyncIterator[rollouts_pb2.RolloutPayload]:
            for item in batch:
                yield rollouts_pb2.RolloutPayload(rollout_id=item.group.rollout_id, group=item.payload)

        return await stub.rpc_push_rollouts(messages())

    def backoff(self, failures: int) -> float:
        """Seconds a trainer is not pushed to after ``failures`` failed pushes in a row: ``first_retry``
        doubling up to ``retry_cooldown`` (one lost push must not idle the only trainer of a run for long)."""
        cfg = self.config
        return min(cfg.retry_cooldown, cfg.first_retry * 2 ** max(0, failures - 1))

    def _settle(self, trainer: _Trainer, batch: list[_Item], ack: rollouts_pb2.PushAck) -> list[_Item]:
        """Count the verdicts of a push; returns the groups to send again."""
        trainer.failures = 0
        if ack.policy_version > (self.trainer_version if self.trainer_version is not None else -1):
            self.trainer_version = int(ack.policy_version)
            if self.on_trainer_version is not None:
                self.on_trainer_version(self.trainer_version)
        if ack.free_room >= 0:
            trainer.room, trainer.stamp = int(ack.free_room), time.time()
        requeue = []
        for index, item in enumerate(batch):  # verdicts come in the order the groups were sent
            verdict = ack.acks[index] if index < len(ack.acks) else None
            if verdict is not None and verdict.rollout_id != item.group.rollout_id:
                verdict = None
            if verdict is None:  # not read by the trainer (over its per-push limit): send again
                requeue.append(item)
            elif verdict.status in DELIVERED:
                self.counters["acked"] += 1
                if verdict.status == Status.DUPLICATE:
                    self.counters["duplicates"] += 1
            elif verdict.reason == Reason.BUFFER_FULL.value:  # kept until some trainer has room, however long
                requeue.append(item)
                trainer.room, trainer.stamp = 0, time.time()
                # a trainer drains its buffer in well under its heartbeat: probe it again soon with one
                # group (its ack carries the real room) instead of waiting for its next announcement
                trainer.recheck_at = time.monotonic() + self.config.full_recheck
            elif _is_retryable(verdict.reason) and item.refusals + 1 < self.config.max_attempts:
                item.refusals += 1
                requeue.append(item)
            else:
                reason = verdict.reason or "unknown"
                self.rejected[reason] += 1
                if reason == Reason.TOO_STALE.value:
                    version = item.group.policy_version
                    self.stale_floor = version if self.stale_floor is None else max(self.stale_floor, version)
                # staleness is routine in async mode (counted, in the metrics); anything else is worth a line
                log = logger.debug if reason == "too_stale" else logger.warning
                log(
                    "trainer %s rejected rollout %s: %s %s",
                    trainer.peer_id,
                    item.group.rollout_id,
                    verdict.reason,
                    verdict.detail,
                )
        return requeue

    def _choose(self) -> _Trainer | None:
        """The trainer with the most free room now (random among ties), or None."""
        if time.monotonic() - self._refreshed_at >= self.config.refresh_period:
            self._refresh()
        now = time.monotonic()
        usable = [t for t in self._trainers.values() if t.bad_until <= now and t.room > 0]
        if not usable:  # nobody announced room: probe a trainer that said "full" a while ago
            usable = [t for t in self._trainers.values() if t.bad_until <= now and t.recheck_at <= now]
            for t in usable:
                t.recheck_at = now + self.config.full_recheck
            return random.choice(usable) if usable else None
        best = max(t.room for t in usable)
        return random.choice([t for t in usable if t.room == best])

    def _refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        try:
            entries = self.directory.peers()
        except Exception as exc:
            logger.info("reading the trainer list failed: %s", exc)
            return
        own = self.loop.peer_id if self.loop.p2p is not None else None
        seen: dict[str, _Trainer] = {}
        for entry in entries:
            record = entry.record
            if record.role != "trainer" or record.accepts_rollouts is not True or record.state != "running":
                continue
            if record.peer_id == own or record.peer_id in seen:
                continue
            room = record.free_buffer_room if record.free_buffer_room is not None else 1
            known = self._trainers.get(record.peer_id)
            if known is None:
                known = _Trainer(record.peer_id, list(record.maddrs), room, record.updated_at)
            elif record.updated_at > known.stamp:  # a newer announcement than our last ack from it
                known.room, known.stamp, known.maddrs = room, record.updated_at, list(record.maddrs)
            seen[record.peer_id] = known
        self._trainers = seen


def _is_retryable(reason: str) -> bool:
    return reason in {r.value for r in RETRYABLE_REASONS}
