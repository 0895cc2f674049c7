"""Server-streaming RPCs whose last responses are never lost to a stream reset.

Owned here: ``LingeringServicer``, a hivemind ``ServicerBase`` whose server-streaming ``rpc_*`` methods
(one request in, a stream of responses out) are served by ``serve_lingering`` instead of hivemind's own
handler; every other method is registered by hivemind as usual. Callers: ``weights.service.WeightsServicer``
(``rpc_get_chunks``), ``rollouts.sample.SampleServicer`` (``rpc_sample``); the push RPC's own handler
(``rollouts.ingest``) follows the same rule.

Why: p2pd pipes each libp2p stream to a local socket. When the side that *sends* the last bytes closes its
socket first, while the other side's end is still open, the daemon closes the libp2p stream for reading
too, and the goroutine that was reading it may then reset the stream; a reset reaching the caller's daemon
before the caller read the last frames discards them (go-yamux drops a reset stream's buffered data). Found
as ``truncated`` chunk streams between two home peers and as lost push acks. The rule: **the caller closes
first**. The callee, after its last response, sends an end frame (hivemind's ``END_OF_STREAM``, an empty
``RPCError`` frame: the caller's mark of its own end of input, used here in the other direction) when
``end_frame`` says so, then keeps its end open until the caller closes it, discarding what still arrives,
for at most ``linger`` seconds. A caller that knows how many responses it waits for closes after the last
one; others read up to the end frame. hivemind's generic stub reads until the callee closes: it still gets
everything, ``linger`` later.

The request is read with a bound on its size (``max_request_bytes``, from the frame header) and a
deadline; a caller that goes away while responses are produced stops the production, as in hivemind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, closing
from typing import Any

from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto.p2pd_pb2 import RPCError

logger = logging.getLogger(__name__)

#: Most bytes discarded from a caller after the request (its end-of-input frame, the rest of a stream).
LINGER_BYTES = 1 << 20


class LingeringServicer(ServicerBase):
    """A ``ServicerBase`` whose server-streaming methods keep their stream until the caller closes it (see
    the module doc). ``END_FRAME`` names the methods that also send an end frame after their last response
    (their callers cannot count the responses); ``stream_linger`` and ``max_request_bytes`` bound the rest."""

    END_FRAME: frozenset[str] = frozenset()
    stream_linger: float = 5.0
    max_request_bytes: int = 64 * 1024
    request_timeout: float = 10.0

    async def add_p2p_handlers(self, p2p, wrapper: Any = None, *, namespace=None, balanced=False) -> None:
        self._collect_rpc_handlers()
        servicer = self if wrapper is None else wrapper
        registrations = []
        for handler in self._rpc_handlers:
            name = self._get_handle_name(namespace, handler.method_name)
            method = getattr(servicer, handler.method_name)
            if handler.stream_output and not handler.stream_input:
                serve = _lingering_handler(
                    p2p, name, method, handler.request_type, handler.method_name in self.END_FRAME, self
                )
                registrations.append(p2p.add_binary_stream_handler(name, serve, balanced=balanced))
            else:
                registrations.append(
                    p2p.add_protobuf_handler(
                        name,
                        method,
                        handler.request_type,
                        stream_input=handler.stream_input,
                        stream_output=handler.stream_output,
                        balanced=balanced,
                    )
                )
        await asyncio.gather(*registrations)


def _lingering_handler(p2p, name: str, method: Callable, request_type, end_frame: bool, limits) -> Callable:
    async def serve(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        with closing(writer):
            request = await _read_request(reader, request_type, limits)
            if request is None:
                return
            await serve_lingering(method(request, context), reader, writer, end_frame, limits.stream_linger)

    return serve


async def _read_request(reader: asyncio.StreamReader, request_type, limits):
    """The one request of a server-streaming call, or None (garbage, too large, too slow, gone)."""
    try:
        async with asyncio.timeout(limits.request_timeout):
            marker = await reader.readexactly(1)
            length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
            if marker != P2P.MESSAGE_MARKER or length > limits.max_request_bytes:
                return None
            return request_type.FromString(await reader.readexactly(length))
    except Exception:  # a timeout, a broken stream, a request that does not parse: nothing to answer
        return None


async def serve_lingering(
    responses: AsyncIterator,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    end_frame: bool,
    linger: float,
) -> None:
    """Send ``responses`` (then an end frame), then wait up to ``linger`` s for the caller to close. The
    caller closing early (EOF while responses are produced) stops the production."""
    gone = asyncio.create_task(until_closed(reader))
    producing = asyncio.create_task(_send_all(responses, writer, end_frame))
    try:
        await asyncio.wait({producing, gone}, return_when=asyncio.FIRST_COMPLETED)
        if producing.done() and not gone.done():
            await asyncio.wait({gone}, timeout=linger)
    finally:
        for task in (producing, gone):
            task.cancel()
        await asyncio.gather(producing, gone, return_exceptions=True)


async def _send_all(responses: AsyncIterator, writer: asyncio.StreamWriter, end_frame: bool) -> None:
    try:
        async with aclosing(responses):  # a cancelled stream runs the handler's cleanup now, not at GC
            async for response in responses:
                await P2P.send_protobuf(response, writer)
        if end_frame:
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the caller is gone
    except Exception as exc:  # a bug in a handler: tell the caller, as hivemind does
        logger.warning("a stream handler failed", exc_info=True)
        try:
            await P2P.send_protobuf(RPCError(message=f"internal error: {type(exc).__name__}"), writer)
        except Exception:
            pass


async def until_closed(
    reader: asyncio.StreamReader, limit: int = LINGER_BYTES, charge: Callable[[int], None] | None = None
) -> None:
    """Read and discard until the caller closes (EOF or a broken stream), at most ``limit`` bytes (and one
    more: a caller that wrote exactly ``limit`` and then closes is told from one that writes on, and gets a
    clean end, not a reset that may overtake what was sent to it); each read's size goes to ``charge`` (a
    sender's byte quota). The caller bounds the time."""
    left = limit
    try:
        while left > 0:
            chunk = await reader.read(min(64 * 1024, left))
            if not chunk:
                return
            left -= len(chunk)
            if charge is not None:
                charge(len(chunk))
        extra = await reader.read(1)  # b"" at the caller's close; a byte: it writes on, stop reading
        if extra and charge is not None:
            charge(len(extra))
    except Exception:  # a reset or a broken pipe: the caller is gone
        return
