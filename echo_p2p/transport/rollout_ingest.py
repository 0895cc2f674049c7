"""Trainer side of the async push (``--mode async``): validate the rollout groups inference peers push, and
acknowledge each one.

Owned here: ``RolloutIngestServicer``. ``rpc_push_rollouts`` reads a stream of ``RolloutPayload`` (one group
each) and answers one ``PushAck`` with a verdict per group. Limits on message size and count are enforced on
receipt; every group goes through the injected ``validate`` (``IngestValidator``) before ``buffer.add``;
verdicts carry a ``Reason`` back and are counted per sender (``SenderStats``). An id already accepted is
acknowledged as DUPLICATE (delivered), so a sender whose ack was lost stops resending. Never raises.
The sending side is ``rollout_push.RolloutPusher``. Caller: the trainer peer. Must not import torch; blocking
work never runs in the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind's ServicerBase needs typing's for streams

from hivemind.p2p import P2PContext, ServicerBase

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import RolloutGroup
from echo_p2p.train.buffer import AddResult, ReplayBuffer, ScoredGroup
from echo_p2p.train.ingest import Reason, Rejection
from echo_p2p.transport.rollout_config import IngestServerConfig

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
