"""Server-streaming RPCs over two real p2pd daemons on 127.0.0.1 (``transport.streams.LingeringServicer``):
the end frame, the caller closing first, the linger bound, and a stranger's oversized request."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator  # noqa: UP035 - hivemind's ServicerBase reads typing's

import pytest
from hivemind.p2p import P2P

from echo_p2p.proto import weights_pb2
from echo_p2p.transport.streams import LingeringServicer
from echo_p2p.transport.weights.stream import ChunkStream

pytestmark = pytest.mark.timeout(120)
LOOP = ["/ip4/127.0.0.1/tcp/0"]
PART = b"x" * 65536


class Parts(LingeringServicer):
    END_FRAME = frozenset({"rpc_parts"})
    stream_linger = 1.0
    max_request_bytes = 1024

    async def rpc_parts(
        self, request: weights_pb2.ChunksRequest, context
    ) -> AsyncIterator[weights_pb2.ChunkPart]:
        for index in request.indices:
            yield weights_pb2.ChunkPart(index=index, data=PART)


def test_a_stream_ends_with_an_end_frame_and_the_caller_closes_first():
    async def main():
        server = await P2P.create(host_maddrs=LOOP)
        client = await P2P.create(host_maddrs=LOOP, initial_peers=await server.get_visible_maddrs())
        servicer = Parts()
        await servicer.add_p2p_handlers(server, namespace="t")
        name = servicer._get_handle_name("t", "rpc_parts")
        try:

            async def call(indices, close_at_end=True):
                _, reader, writer = await client.call_binary_stream_handler(server.peer_id, name)
                await P2P.send_protobuf(weights_pb2.ChunksRequest(indices=indices), writer)
                await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
                stream = ChunkStream(reader, writer, max_frame=1 << 20)
                got = []
                while (part := await stream.next(10)) is not None:
                    got.append(part.index)
                started = time.monotonic()
                assert not reader.at_eof()  # the end came as a frame: the callee still holds its end
                if close_at_end:
                    stream.close()
                    return got, 0.0
                # a caller that waits for the callee to close (hivemind's generic stub) gets EOF after
                # the linger
                assert await reader.read() == b""
                return got, time.monotonic() - started

            for _ in range(20):  # every part arrives, then a clean end (the end frame, not an EOF)
                got, _ = await call(list(range(8)))
                assert got == list(range(8))
            got, waited = await call([1, 2], close_at_end=False)
            assert got == [1, 2] and 0.8 <= waited < 5

            # a stranger's oversized or garbage request is dropped without an answer
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, name)
            writer.write(P2P.MESSAGE_MARKER + (1 << 30).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())
