"""Trainer side of the async push (``--mode async``): validate the rollout groups inference peers push, and
acknowledge each one.

Owned here: ``RolloutIngestServicer``. The push RPC reads a stream of ``RolloutPayload`` (one group each) and
answers one ``PushAck`` with a verdict per group. It is served as a binary stream with hivemind's framing
(wire-compatible with ``rpc_push_rollouts``' stub), so that each frame's length is checked before its body
is read: a frame above ``max_group_bytes``, or beyond the sender's byte quota, is refused from its 9-byte
header, and a sender in CPU debt is refused before anything it sent is read (``PushAck.error``, counted).
Every group then goes through cheap checks (count, size, that it is the sampler, duplicate id or content)
before the injected ``validate`` (``IngestValidator``) and ``buffer.add``; a full buffer makes room for a
sender below its share (capacity / (active senders + 1)) at the expense of one above it, and refuses
(``buffer_full``, retryable: back-pressure) the others; verdicts carry a ``Reason`` back and are counted per sender (``SenderStats``). An id already
accepted is acknowledged as DUPLICATE (delivered), so a sender whose ack was lost stops resending. After
the ack the stream stays open until the sender closes it (``_linger``: a stream closed first by its
receiver can be reset, and the reset can overtake the ack). Never raises.
Pacing (``train.pacing.Pacer``, optional): every ack carries the sender's grant, ``PushAck.wanted``, the groups
this trainer asks it to sample now; a push of no payload is a room query, held up to ``query_wait`` until
there is a grant (one held query per sender, each charged ``QUERY_COST`` of the sender's CPU quota), and
every validated group is charged to its sender's grant (``Pacer.charge``; beyond the grant and a small
allowance: ``not_granted``, retryable).
Useless help: a valid group whose re-scored rewards are all equal is refused (``no_signal``, DAPO's dynamic
sampling: its advantage is 0) and a group whose completions were accepted already, in any order and under any
version, is refused unvalidated (``duplicate_content``); neither takes a buffer slot, and neither is a strike
(an honest sampler whose policy is always right sends such groups). Their rewards still count in
``received_reward_mean``, the mean reward of the last ``received_reward_window`` groups received (a duplicate
with the mean remembered for its content), which a trainer logs beside the reward of what it trains on.
Streams: a sender holds at most ``max_streams_per_sender`` push streams at once and all senders together
``max_streams`` (senders never accepted yet half of them); a stream beyond is answered ``too_many_streams``
and closed unread, so held or dripping streams cost a bounded number of file descriptors.
The sending side is ``rollouts.push.RolloutPusher``. Caller: the trainer peer. Must not import torch; blocking
work never runs in the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind's ServicerBase needs typing's for streams

from hivemind.p2p import P2P, P2PContext, ServicerBase

from echo_p2p.guard.quota import PeerQuotas
from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import RolloutGroup
from echo_p2p.train.buffer import AddResult, ReplayBuffer
from echo_p2p.train.pacing import Pacer
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.transport.rollouts.config import IngestServerConfig
from echo_p2p.transport.rollouts.refusals import Reason, Rejection
from echo_p2p.transport.streams import until_closed

logger = logging.getLogger(__name__)

Status = rollouts_pb2.GroupAck.Status
DELIVERED = (Status.ACCEPTED, Status.DUPLICATE)
#: Bytes of a ``RolloutPayload`` frame beyond its group (the rollout id and protobuf tags).
PAYLOAD_OVERHEAD = 256
#: Push-level refusals (``PushAck.error`` starts with one of them; counted per sender).
RATE_LIMITED = "rate_limited"
FRAME_TOO_LARGE = "frame_too_large"
BAD_FRAME = "bad_frame"
BANNED = "banned"
#: Most bytes discarded while a push stream lingers after its ack (about what a sender has in flight).
LINGER_BYTES = 16 * 1024 * 1024
#: What a push stream may still read after its ack whatever the sender's quota (its end-of-stream frame).
LINGER_FLOOR = 64 * 1024
#: Refusals of senders that break the protocol: their streams linger for ``LINGER_FLOOR`` bytes at most.
VIOLATIONS = (FRAME_TOO_LARGE, BAD_FRAME, BANNED)
#: A push stream beyond the sender's or the trainer's stream limit (closed unread).
TOO_MANY_STREAMS = "too_many_streams"
#: Seconds an answer to a stream refused for the stream limits may take to write.
REFUSAL_WRITE_TIMEOUT = 1.0
#: CPU seconds a room query is charged to its sender's quota (the p2pd stream and the wake-ups it costs).
QUERY_COST = 0.002
#: Seconds between two looks at the buffer while a room query is held.
QUERY_POLL = 0.05
#: A group whose re-scored rewards spread over no more than this carries no signal (``no_signal``).
NO_SIGNAL_SPREAD = 1e-9


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
    :param is_banned: ``peer_id -> bool``: senders whose pushes are refused unread (``banned``)
    :param pacer: grants senders what will be trained on (``PushAck.wanted``); None: acks say -1 (not paced)
    """

    def __init__(
        self,
        validate: Callable[[RolloutGroup], ScoredGroup | Rejection],
        buffer: ReplayBuffer,
        config: IngestServerConfig | None = None,
        current_version: Callable[[], int] | None = None,
        is_banned: Callable[[str], bool] | None = None,
        pacer: Pacer | None = None,
    ) -> None:
        self.validate = validate
        self.pacer = pacer
        self._querying: set[str] = set()  # senders with a room query held (one each)
        self.is_banned = is_banned
        self.buffer = buffer
        self.config = config or IngestServerConfig()
        self.current_version = current_version
        self.senders: OrderedDict[str, SenderStats] = OrderedDict()
        self.totals = SenderStats()
        self.pushes = 0
        self.queries = 0  # room queries (pushes of no payload)
        self._accepted_ids: OrderedDict[str, None] = OrderedDict()
        # content key -> mean re-scored reward of the group that had it
        self._accepted_content: OrderedDict[bytes, float] = OrderedDict()
        self._received: deque[float] = deque(maxlen=self.config.received_reward_window)
        self._streams: Counter[str] = Counter()  # open push streams per sender
        self._stranger_streams = 0  # open push streams of senders none of whose groups was accepted
        self._active: OrderedDict[str, float] = (
            OrderedDict()
        )  # sender -> monotonic time of its last accepted group
        burst = self.config.sender_burst_seconds
        self._bytes = PeerQuotas(
            self.config.sender_bytes_per_second, self.config.sender_bytes_per_second * burst
        )
        self._cpu = PeerQuotas(self.config.sender_cpu_share, self.config.sender_cpu_share * burst)
        self._lock = threading.Lock()
        # one worker: validation (tokenizer, verifier) runs off the loop and never concurrently with itself
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="echo-ingest")

    # ---- the push RPC ----------------------------------------------------------------------------------
    @property
    def max_frame(self) -> int:
        return self.config.max_group_bytes + PAYLOAD_OVERHEAD

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False) -> None:
        """Serve the push RPC as a binary stream (see the module doc) under ``rpc_push_rollouts``' name."""
        name = self._get_handle_name(namespace, "rpc_push_rollouts")
        await p2p.add_binary_stream_handler(name, self._handle_push_stream, balanced=balanced)

    async def remove_p2p_handlers(self, p2p, *, namespace=None) -> None:
        await p2p.remove_binary_stream_handler(self._get_handle_name(namespace, "rpc_push_rollouts"))

    async def _handle_push_stream(self, stream_info, reader: asyncio.StreamReader, writer) -> None:
        try:
            sender = stream_info.peer_id.to_base58()
        except Exception:
            sender = "?"
        with closing(writer):
            stranger = self._open_stream(sender)
            if stranger is None:
                await self._refuse_stream(sender, writer)
                return
            try:
                await self._serve_push(sender, reader, writer)
            finally:
                self._close_stream(sender, stranger)

    def _open_stream(self, sender: str) -> bool | None:
        """Count a new push stream of ``sender``; None when it is beyond the limits (see the module doc), else
        whether it counts among the strangers' half."""
        cfg = self.config
        with self._lock:
            stats = self.senders.get(sender)
            stranger = stats is None or stats.accepted == 0
            total = sum(self._streams.values())
            if (
                self._streams[sender] >= cfg.max_streams_per_sender
                or total >= cfg.max_streams
                or (stranger and self._stranger_streams >= cfg.max_streams // 2)
            ):
                return None
            self._streams[sender] += 1
            self._stranger_streams += stranger
            return stranger

    def _close_stream(self, sender: str, stranger: bool) -> None:
        with self._lock:
            self._streams[sender] -= 1
            if self._streams[sender] <= 0:
                del self._streams[sender]
            self._stranger_streams -= stranger

    def open_streams(self) -> int:
        """Push streams open now."""
        with self._lock:
            return sum(self._streams.values())

    async def _refuse_stream(self, sender: str, writer) -> None:
        self._count_refusal(sender, TOO_MANY_STREAMS)
        ack = rollouts_pb2.PushAck(
            error=f"{TOO_MANY_STREAMS}: at most {self.config.max_streams_per_sender} push streams per sender",
            free_room=self._free_room(),
            policy_version=self._version(),
            wanted=-1 if self.pacer is None else 0,
        )
        try:
            async with asyncio.timeout(REFUSAL_WRITE_TIMEOUT):
                await P2P.send_protobuf(ack, writer)
        except Exception:  # a sender that does not read its answers gets none
            pass

    async def _serve_push(self, sender: str, reader: asyncio.StreamReader, writer) -> None:
        messages, refusal = await self._read_push(sender, reader)
        ack = await self._answer(sender, messages, refusal)
        try:
            await P2P.send_protobuf(ack, writer)
        except Exception as exc:  # the sender may be gone: it resends, and a resend is acked DUPLICATE
            logger.info("push from %s: the ack was not delivered (%r)", sender, exc)
            return
        await self._linger(sender, reader, refusal)

    async def _linger(self, sender: str, reader: asyncio.StreamReader, refusal: str | None = None) -> None:
        """Keep the stream after the ack until the sender closes it, discarding what still arrives (the rest
        of a refused push), for at most ``ack_linger`` seconds and ``LINGER_BYTES``; no more than the sender's
        byte quota has left (``LINGER_FLOOR`` whatever it has: the end-of-stream frame), and only the floor
        after a protocol violation (``VIOLATIONS``: a frame above the limit, garbage, a banned sender). Each
        such push costs the trainer a header and the floor, however much the sender keeps writing: its ack
        may then be lost to a reset, which only a sender that breaks the rules risks (an honest one past its
        quota resends later).

        Why: p2pd pipes each stream to a local socket, and when that socket is closed while the sender's data
        is unread or its side is still open, the daemon may *reset* the stream; a reset arriving at the
        sender's daemon before the sender read the ack discards the ack (the push then looks failed, its groups
        are resent). A sender that closes first, once it has the ack (``rollouts.push.push_payloads``), never
        loses one. hivemind's generic stub waits for the trainer to close: it gets its ack ``ack_linger`` later.
        """
        limit = LINGER_FLOOR
        if refusal is None or not refusal.startswith(VIOLATIONS):
            limit = max(LINGER_FLOOR, min(LINGER_BYTES, int(self._bytes.available(sender))))
        try:
            async with asyncio.timeout(self.config.ack_linger):
                await until_closed(reader, limit, lambda n: self._bytes.charge(sender, n))
        except TimeoutError:
            logger.debug(
                "push from %s: the sender kept the stream %.0f s past its ack", sender, self.config.ack_linger
            )

    async def _read_push(
        self, sender: str, reader: asyncio.StreamReader
    ) -> tuple[list[rollouts_pb2.RolloutPayload], str | None]:
        """The payloads of one push, read frame by frame, and why reading stopped early (None: it did not)."""
        messages: list[rollouts_pb2.RolloutPayload] = []
        if self.is_banned is not None and self.is_banned(sender):
            return messages, f"{BANNED}: this trainer banned the sender"
        if not self._cpu.allows(sender, 0.0):
            return messages, f"{RATE_LIMITED}: validation time beyond {self.config.sender_cpu_share:g} s/s"
        try:
            async with asyncio.timeout(self.config.stream_timeout):
                while len(messages) <= self.config.max_groups_per_push:
                    marker = await reader.readexactly(1)
                    length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
                    if length > self.max_frame:
                        return messages, f"{FRAME_TOO_LARGE}: a {length}-byte frame (limit {self.max_frame})"
                    if not self._bytes.allows(sender, length):
                        return (
                            messages,
                            f"{RATE_LIMITED}: beyond {self.config.sender_bytes_per_second:.0f} B/s",
                        )
                    self._bytes.charge(sender, length)
                    body = await reader.readexactly(length)
                    if marker == P2P.ERROR_MARKER:
                        break  # hivemind's end-of-stream frame
                    if marker != P2P.MESSAGE_MARKER:
                        return messages, f"{BAD_FRAME}: unknown frame marker"
                    try:
                        messages.append(rollouts_pb2.RolloutPayload.FromString(body))
                    except Exception:  # protobuf raises DecodeError and others on garbage
                        return messages, f"{BAD_FRAME}: not a RolloutPayload"
        except TimeoutError:
            logger.info("push from %s: stream not finished in %.0f s", sender, self.config.stream_timeout)
        except asyncio.IncompleteReadError:
            pass  # the sender closed the stream early: answer for what was read
        except Exception as exc:  # a broken stream: answer for what was read
            logger.info("push from %s: stream failed (%s)", sender, exc)
        return messages, None

    async def rpc_push_rollouts(
        self, requests: AsyncIterator[rollouts_pb2.RolloutPayload], context: P2PContext
    ) -> rollouts_pb2.PushAck:
        """The same RPC for in-process callers (tests): payloads already parsed, no frame checks."""
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
        return await self._answer(sender, messages, None)

    async def _answer(
        self, sender: str, messages: list[rollouts_pb2.RolloutPayload], refusal: str | None
    ) -> rollouts_pb2.PushAck:
        try:
            if refusal is not None:
                self._count_refusal(sender, refusal.split(":", 1)[0])
                if not messages:
                    return rollouts_pb2.PushAck(  # a refused sender is granted nothing
                        error=refusal,
                        free_room=self._free_room(),
                        policy_version=self._version(),
                        wanted=-1 if self.pacer is None else 0,
                    )
            if not messages and refusal is None:
                return await self._room_query(sender)
            loop = asyncio.get_running_loop()
            acks = await loop.run_in_executor(self._worker, self._process, sender, messages)
            return rollouts_pb2.PushAck(
                acks=acks,
                free_room=self._free_room(),
                policy_version=self._version(),
                wanted=self._wanted(sender),
            )
        except Exception as exc:  # never raise to the caller: it would only see a generic error
            logger.exception("processing a push from %s failed", sender)
            return rollouts_pb2.PushAck(
                error=f"internal error: {type(exc).__name__}", free_room=-1, wanted=-1
            )

    async def _room_query(self, sender: str) -> rollouts_pb2.PushAck:
        """A push of no payload: answered once this trainer grants ``sender`` groups, or after ``query_wait``
        (at once when not paced, or when the sender has a query held already)."""
        with self._lock:
            self.queries += 1
        self._cpu.charge(sender, QUERY_COST)
        wanted = self._wanted(sender)
        if self.pacer is not None and wanted == 0 and sender not in self._querying:
            self._querying.add(sender)
            try:
                deadline = time.monotonic() + self.pacer.config.query_wait
                while wanted == 0 and time.monotonic() < deadline:
                    await asyncio.sleep(QUERY_POLL)
                    wanted = self._wanted(sender)
            finally:
                self._querying.discard(sender)
        return rollouts_pb2.PushAck(
            free_room=self._free_room(), policy_version=self._version(), wanted=wanted
        )

    def _wanted(self, sender: str) -> int:
        """``sender``'s grant now (-1: not paced)."""
        if self.pacer is None:
            return -1
        try:
            usable = self.buffer.num_usable(self._version())
            with self._lock:
                stats = self.senders.get(sender)
                proven = stats is not None and stats.accepted > 0
            return self.pacer.grant(sender, usable, proven)
        except Exception:
            logger.exception("pacing failed")
            return -1

    # ---- stats ------------------------------------------------------------------------------------------
    def sender_stats(self, peer_id: str) -> SenderStats:
        """A copy of ``peer_id``'s counters (zeros if it never pushed)."""
        with self._lock:
            stats = self.senders.get(peer_id, SenderStats())
            return SenderStats(stats.accepted, stats.duplicates, Counter(stats.rejected), stats.last_seen)

    def received_reward_mean(self) -> float | None:
        """Mean re-scored reward of the last ``received_reward_window`` groups received (see the module doc);
        None before the first."""
        with self._lock:
            return sum(self._received) / len(self._received) if self._received else None

    def stats(self) -> dict[str, Any]:
        mean = self.received_reward_mean()
        with self._lock:
            return {
                "pushes": self.pushes,
                "queries": self.queries,
                "received_reward_mean": None if mean is None else round(mean, 4),
                "open_streams": sum(self._streams.values()),
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
            t0 = time.perf_counter()
            status, reason, detail = self._verdict(sender, index, message)
            self._cpu.charge(sender, time.perf_counter() - t0)
            acks.append(
                rollouts_pb2.GroupAck(
                    rollout_id=message.rollout_id[:128], status=status, reason=reason, detail=detail[:256]
                )
            )
            self._count(sender, status, reason)
        return acks

    def _verdict(self, sender: str, index: int, message: rollouts_pb2.RolloutPayload) -> tuple[int, str, str]:
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
        if group.sampler_peer_id not in ("", sender):
            return Status.REJECTED, Reason.NOT_THE_SAMPLER.value, "sampler_peer_id is not the pushing peer"
        group.sampler_peer_id = sender  # what the buffer's per-sender share counts
        content = group.content_key()
        with self._lock:
            if group.rollout_id in self._accepted_ids:
                return Status.DUPLICATE, Reason.DUPLICATE.value, "already accepted"
            remembered = self._accepted_content.get(content)
            if remembered is not None:
                self._accepted_content.move_to_end(content)
                self._received.append(remembered)
        if remembered is not None:
            if self.pacer is not None:
                self.pacer.charge(sender)  # useless help uses up the sender's grant like useful help
            return (
                Status.REJECTED,
                Reason.DUPLICATE_CONTENT.value,
                "these completions were received already",
            )
        share = self._sender_share(sender)
        if (
            config.refuse_when_full
            and self.buffer.free_room() <= 0
            and not self.buffer.can_make_room_for(sender, share)
        ):
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
        if self.pacer is not None and not self.pacer.charge(sender):
            return Status.REJECTED, Reason.NOT_GRANTED.value, "beyond this sender's grant: ask for room first"
        reward = sum(result.rewards) / len(result.rewards)
        with self._lock:
            self._received.append(reward)
        if config.drop_no_signal and max(result.rewards) - min(result.rewards) <= NO_SIGNAL_SPREAD:
            self._remember(group.rollout_id, content, sender, reward, active=False)
            return Status.REJECTED, Reason.NO_SIGNAL.value, "every completion has the same reward"
        added = self.buffer.add(
            result,
            self._version() if self.current_version is not None else None,
            sender_share=share,
        )
        if added is AddResult.ADDED and self.pacer is not None and self.current_version is not None:
            self.pacer.observe(self._version() - group.policy_version)
        if added is AddResult.ADDED or added is AddResult.DUPLICATE:
            self._remember(group.rollout_id, content, sender, reward)
            if added is AddResult.DUPLICATE:
                return Status.DUPLICATE, Reason.DUPLICATE.value, "already in the buffer"
            return Status.ACCEPTED, "", ""
        if added is AddResult.STALE:
            return Status.REJECTED, Reason.TOO_STALE.value, "too stale for the buffer"
        return Status.REJECTED, Reason.BUFFER_FULL.value, "evicted at once: older than every buffered group"

    def _remember(
        self, rollout_id: str, content: bytes, sender: str, reward: float, active: bool = True
    ) -> None:
        """A group received: its id (an accepted one; a resend is DUPLICATE) and its content with its mean
        reward; ``active``: it entered the buffer, so its sender counts in the buffer's shares."""
        with self._lock:
            if active:
                self._accepted_ids[rollout_id] = None
            self._accepted_content[content] = reward
            for seen in (self._accepted_ids, self._accepted_content):
                while len(seen) > self.config.accepted_ids_window:
                    seen.popitem(last=False)
            if not active:
                return
            self._active[sender] = time.monotonic()
            self._active.move_to_end(sender)
            while len(self._active) > self.config.max_tracked_senders:
                self._active.popitem(last=False)

    def active_senders(self) -> int:
        """Senders with a group accepted into the buffer within ``active_sender_window`` seconds."""
        with self._lock:
            return self._active_count()

    def _active_count(self, sender: str | None = None) -> int:
        """``active_senders`` (caller holds the lock), counting ``sender`` as one if it is not among them."""
        cutoff = time.monotonic() - self.config.active_sender_window
        while self._active and next(iter(self._active.values())) < cutoff:
            self._active.popitem(last=False)
        return len(self._active) + (sender is not None and sender not in self._active)

    def _sender_share(self, sender: str) -> int:
        """Buffer entries one sender may hold: an equal part of the capacity among the active senders and one
        more (room is always left for a newcomer: the first sender cannot take the whole buffer)."""
        with self._lock:
            active = self._active_count(sender)
        capacity = getattr(self.buffer, "capacity", 0)
        return max(self.config.min_sender_share, capacity // (active + 1))

    def _count_refusal(self, sender: str, reason: str) -> None:
        """A push refused as a whole (rate, frame): counted once per push, like a group reason."""
        with self._lock:
            self.pushes += 1
            for target in (self._sender(sender), self.totals):
                target.rejected[reason] += 1

    def _sender(self, sender: str) -> SenderStats:
        """``sender``'s counters (caller holds the lock); the least recently seen are forgotten."""
        stats = self.senders.get(sender)
        if stats is None:
            stats = self.senders[sender] = SenderStats()
            while len(self.senders) > self.config.max_tracked_senders:
                self.senders.popitem(last=False)
        self.senders.move_to_end(sender)
        stats.last_seen = time.time()
        return stats

    def _count(self, sender: str, status: int, reason: str) -> None:
        with self._lock:
            stats = self._sender(sender)
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
