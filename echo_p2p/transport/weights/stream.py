"""Client side of one chunk stream: hivemind's framing read frame by frame, bounded before each body.

Owned here: ``ChunkStream`` (reads ``ChunkPart`` frames of an ``rpc_get_chunks`` stream; a frame longer than
the limit is refused before its body is read) and what its frames can raise (``StreamViolation``: the
provider broke the stream protocol, a ban; ``RemoteError``: it sent an error frame). Callers:
``service.WeightsEndpoint`` opens the stream, ``fetch.reader`` reads it. Must not know about chunk stores.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P

from echo_p2p.proto import weights_pb2


class StreamViolation(Exception):
    """A provider broke the stream protocol (oversized frame, garbage): ``reason`` names how."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RemoteError(Exception):
    """The provider's handler failed and sent an error frame."""


class ChunkStream:
    """Client side of one ``rpc_get_chunks`` stream, read frame by frame with hivemind's framing.

    A frame longer than ``max_frame`` is refused before its body is read (``StreamViolation('oversized')``),
    so a provider cannot make a receiver buffer an arbitrary message.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int):
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame

    async def next(self, timeout: float) -> weights_pb2.ChunkPart | None:
        """The next part, or None at a clean end of stream; ``TimeoutError`` when nothing came in time;
        ``asyncio.IncompleteReadError`` when the stream broke inside a frame."""
        return await asyncio.wait_for(self._next(), timeout)

    async def _next(self) -> weights_pb2.ChunkPart | None:
        try:
            marker = await self.reader.readexactly(1)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise
            return None
        header = await self.reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > self.max_frame:
            raise StreamViolation("oversized", f"a {length}-byte frame (limit {self.max_frame})")
        body = await self.reader.readexactly(length)
        if marker == P2P.MESSAGE_MARKER:
            try:
                return weights_pb2.ChunkPart.FromString(body)
            except Exception as exc:  # protobuf raises DecodeError and others on garbage
                raise StreamViolation("malformed_part", str(exc)) from None
        if marker == P2P.ERROR_MARKER:
            from hivemind.proto.p2pd_pb2 import RPCError

            if not body:  # the provider's end frame (``transport.streams``): a clean end
                return None

            try:
                message = RPCError.FromString(body).message
            except Exception:
                message = "(unreadable error)"
            raise RemoteError(message[:200])
        raise StreamViolation("malformed_part", f"unknown frame marker {marker!r}")

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # already closed by the peer
            pass
