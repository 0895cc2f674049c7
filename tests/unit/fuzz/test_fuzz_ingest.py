"""Fuzz: a trainer's rollout ingest (``RolloutIngestServicer.rpc_push_rollouts``) called directly with what a
hostile inference peer can push: garbage, truncated, oversized and mislabelled payloads, too many of them,
streams that break or never end. Every push gets one ack per message read, each with a status and (when
refused) a reason; no internal error, no hang, and an oversized payload is refused without being parsed."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo_p2p.proto import rollouts_pb2
from echo_p2p.train.buffer import ReplayBuffer
from echo_p2p.transport.rollouts.config import IngestServerConfig
from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer
from echo_p2p.transport.rollouts.refusals import Reason
from tests.unit.fuzz.fuzzing import FUZZ, broken, context, hostile_bytes, packed, peak_allocated, run
from tests.unit.fuzz.test_fuzz_rollouts import HONEST, HONEST_BYTES, HONEST_DICT, VALIDATOR, VERSION

pytestmark = pytest.mark.timeout(120)
Status = rollouts_pb2.GroupAck.Status
LIMITS = IngestServerConfig(max_groups_per_push=4, max_group_bytes=4096, stream_timeout=2.0)
REASONS = {r.value for r in Reason} - {Reason.INTERNAL_ERROR.value}


@pytest.fixture(scope="module")
def ingest():
    buffer = ReplayBuffer(capacity=8, max_staleness=2)
    servicer = RolloutIngestServicer(
        lambda g: VALIDATOR.validate(g, VERSION), buffer, LIMITS, current_version=lambda: VERSION
    )
    yield servicer
    servicer.shutdown()


async def stream(messages, end: str = "clean"):
    """The push as hivemind hands it over: an async iterator that ends, breaks or hangs after the messages."""
    for message in messages:
        yield message
    if end == "broken":
        raise ConnectionResetError("the sender went away")
    if end == "hang":
        await asyncio.sleep(3600)  # the servicer's stream_timeout must end the read


group_bytes = hostile_bytes(
    HONEST_BYTES, extra=st.builds(packed, broken(HONEST_DICT)) | st.binary(min_size=4097, max_size=6000)
)
payloads = st.builds(
    rollouts_pb2.RolloutPayload,
    rollout_id=st.sampled_from([HONEST.rollout_id, ""]) | st.text(max_size=200),
    group=group_bytes,
)


def check(ack: rollouts_pb2.PushAck, sent: list[rollouts_pb2.RolloutPayload]) -> None:
    assert not ack.error, ack.error
    assert len(ack.acks) == min(len(sent), LIMITS.max_groups_per_push + 1)
    for i, (a, message) in enumerate(zip(ack.acks, sent, strict=False)):
        assert a.rollout_id == message.rollout_id[:128]
        assert a.status in (Status.ACCEPTED, Status.DUPLICATE, Status.REJECTED)
        if a.status == Status.REJECTED:
            assert a.reason in REASONS, (a.reason, a.detail)
            assert len(a.detail) <= 256
        if i >= LIMITS.max_groups_per_push:
            assert (a.status, a.reason) == (Status.REJECTED, Reason.TOO_MANY.value)
        elif len(message.group) > LIMITS.max_group_bytes:
            assert (a.status, a.reason) == (Status.REJECTED, Reason.TOO_LARGE.value)


@FUZZ
@given(st.lists(payloads, max_size=7), st.sampled_from(["clean", "broken"]))
def test_every_message_read_gets_a_verdict_with_a_reason(loop, ingest, messages, end):
    ack = run(loop, ingest.rpc_push_rollouts(stream(messages, end), context()))
    check(ack, messages)


def test_a_stream_that_never_ends_is_answered_after_stream_timeout(loop, ingest):
    messages = [rollouts_pb2.RolloutPayload(rollout_id="x", group=b"\x00")]
    ack = run(loop, ingest.rpc_push_rollouts(stream(messages, "hang"), context()))
    check(ack, messages)
    assert ack.acks[0].reason == Reason.MALFORMED.value


def test_an_oversized_payload_is_refused_without_being_parsed(loop, ingest):
    """64 MiB in one message (hivemind has read the frame already): refused on its length alone, not parsed.
    Reading a protobuf bytes field copies it (upb), so one transient copy is the floor here; refusing the
    frame before it is read is the stream reader's job."""
    size = 64 << 20
    huge = rollouts_pb2.RolloutPayload(rollout_id="huge", group=HONEST_BYTES[:-1] + b"\x00" * size)
    ack, peak = peak_allocated(lambda: run(loop, ingest.rpc_push_rollouts(stream([huge]), context())))
    assert [(a.status, a.reason) for a in ack.acks] == [(Status.REJECTED, Reason.TOO_LARGE.value)]
    assert peak < size + (1 << 20)  # at most that one copy: no parse, no second copy held


def raw_stream(loop: asyncio.AbstractEventLoop, data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(loop=loop)  # not the thread's current loop: there may be none
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def frame(marker: bytes, body: bytes, claimed: int | None = None) -> bytes:
    from hivemind.p2p import P2P

    length = len(body) if claimed is None else claimed
    return marker + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


frames = st.lists(
    st.builds(
        frame,
        st.sampled_from([b"\x00", b"\x01", b"\x02", b"\xff"]),  # message, error (end of stream), junk markers
        st.builds(lambda m: m.SerializeToString(), payloads) | st.binary(max_size=64),
        st.none() | st.integers(0, 1 << 40),  # lengths that lie: short, long, absurd
    ),
    max_size=6,
).map(b"".join) | st.binary(max_size=200)


@FUZZ
@given(frames)
def test_the_push_frame_reader_refuses_from_headers_and_never_reads_past_a_limit(loop, ingest, data):
    """What a stranger writes on the push stream itself: any bytes, lying lengths, junk markers, a cut
    stream. The reader returns the payloads it could read and why it stopped; it never raises or hangs, and
    never accepts a frame longer than the limit."""
    messages, refusal = run(loop, ingest._read_push("fuzzer", raw_stream(loop, data)))
    assert len(messages) <= LIMITS.max_groups_per_push + 1
    assert refusal is None or refusal.split(":")[0] in (
        "frame_too_large",
        "rate_limited",
        "bad_frame",
        "banned",
    )
    assert all(len(m.SerializeToString()) <= ingest.max_frame for m in messages)


def test_a_frame_claiming_a_terabyte_is_refused_from_its_header(loop, ingest):
    data = frame(b"\x00", b"\x00" * 16, claimed=1 << 40)
    (messages, refusal), peak = peak_allocated(
        lambda: run(loop, ingest._read_push("big", raw_stream(loop, data)))
    )
    assert messages == [] and refusal.startswith("frame_too_large")
    assert peak < 1 << 20
