"""Per-peer quotas and the ingest's refusals that happen before a push is read."""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from echo_p2p.guard.quota import PeerQuotas, TokenBucket
from echo_p2p.proto import rollouts_pb2
from echo_p2p.train.buffer import ReplayBuffer
from echo_p2p.transport.rollouts.config import IngestServerConfig
from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer


def test_token_bucket_refills_at_its_rate_caps_at_its_burst_and_carries_debt():
    bucket = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    assert bucket.allows(20.0, now=0.0) and bucket.allows(
        21.0, now=0.0
    )  # asks above the burst need a full bucket
    bucket.charge(20.0, now=0.0)
    assert not bucket.allows(1.0, now=0.0)
    assert bucket.allows(5.0, now=0.5)  # 5 refilled in half a second
    bucket.charge(30.0, now=0.5)  # a cost known afterwards: the bucket goes into debt
    assert not bucket.allows(0.0, now=2.0)  # -25 + 15
    assert bucket.allows(0.0, now=3.0)  # debt paid back
    assert bucket.allows(20.0, now=100.0) and bucket.level == 20.0


def test_peer_quotas_are_per_peer_and_bounded():
    quotas = PeerQuotas(rate=1.0, burst=1.0, max_peers=3)
    quotas.charge("a", 1.0, now=0.0)
    assert not quotas.allows("a", 1.0, now=0.0) and quotas.allows("b", 1.0, now=0.0)
    for peer in ("c", "d", "e"):
        quotas.allows(peer, 1.0, now=0.0)
    assert len(quotas._buckets) == 3  # "a" was forgotten: memory stays bounded whatever the number of keys


def frames(*messages: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for body in messages:
        reader.feed_data(P2P.MESSAGE_MARKER + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body)
    reader.feed_data(P2P.ERROR_MARKER + (0).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    reader.feed_eof()
    return reader


def test_a_sender_beyond_its_byte_or_cpu_quota_is_refused_before_its_push_is_read():
    config = IngestServerConfig(sender_bytes_per_second=1024, sender_burst_seconds=2.0, sender_cpu_share=0.1)
    servicer = RolloutIngestServicer(lambda g: None, ReplayBuffer(8, 1), config)
    payload = rollouts_pb2.RolloutPayload(rollout_id="x", group=b"\0" * 900).SerializeToString()

    async def read(sender, *bodies):
        return await servicer._read_push(sender, frames(*bodies))

    try:
        messages, refusal = asyncio.run(read("a", payload, payload))  # 2 x ~905 bytes fit a 2048 burst
        assert len(messages) == 2 and refusal is None
        messages, refusal = asyncio.run(read("a", payload))
        assert messages == [] and refusal.startswith("rate_limited")
        messages, refusal = asyncio.run(read("b", payload))  # another sender has its own quota
        assert len(messages) == 1 and refusal is None
        servicer._cpu.charge("b", 5.0)  # validating its groups took 5 s of CPU: in debt for a while
        messages, refusal = asyncio.run(read("b", payload))
        assert messages == [] and refusal.startswith("rate_limited")
    finally:
        servicer.shutdown()


def test_what_a_push_stream_reads_after_its_ack_is_bounded_by_the_senders_quota_and_conduct():
    """A sender that keeps writing after its ack (the rest of a refused push) is read for at most what its
    byte quota has left, and for only ``LINGER_FLOOR`` bytes after a protocol violation (a frame above the
    limit): before, every push lingered over up to 16 MiB, whatever the sender had done. One byte more than
    the bound is read (``until_closed``: it tells a sender that writes on from one that closes at the bound)."""
    from echo_p2p.transport.rollouts.ingest import LINGER_FLOOR

    floor = LINGER_FLOOR + 1

    config = IngestServerConfig(sender_bytes_per_second=256 * 1024, sender_burst_seconds=4.0, ack_linger=5.0)
    servicer = RolloutIngestServicer(lambda g: None, ReplayBuffer(8, 1), config)

    def flooding() -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        reader.feed_data(b"\0" * (8 << 20))  # 8 MiB written after the ack, and the stream left open
        return reader

    async def linger(sender, refusal):
        reader = flooding()
        await servicer._linger(sender, reader, refusal)
        return (8 << 20) - len(reader._buffer)

    try:
        assert asyncio.run(linger("violator", "frame_too_large: a 26214400-byte frame")) == floor
        assert asyncio.run(linger("garbage", "bad_frame: unknown frame marker")) == floor
        read = asyncio.run(linger("honest", None))  # an accepted push: what its 1 MiB quota has left
        assert 1 << 20 <= read < (1 << 20) + 128 * 1024, read
        assert asyncio.run(linger("honest", "rate_limited: beyond 262144 B/s")) == floor  # in debt now
    finally:
        servicer.shutdown()
