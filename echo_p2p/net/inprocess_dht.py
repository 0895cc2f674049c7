"""A hivemind DHT node in this process: ``hivemind.DHT``'s calls, served by an event loop on a thread.

``hivemind.DHT`` runs its node in a forked child and hands every call over a pipe with an ``MPFuture``,
which imports torch (shared memory for the future's state). A process that only serves and reads records
(the bootstrap) has no training loop to keep the node away from, so ``InProcessDHT`` runs the same
``DHTNode`` on an event loop thread of its own and answers with ``concurrent.futures.Future``s: no torch
(with ``net.lean_hivemind``), no child process, no pickling per call.

It offers the part of ``hivemind.DHT`` that echo_p2p's callers use (``net.node``, ``net.directory``,
``net.trainer_writers``, the monitor): ``start``/``wait_until_ready``, ``store``, ``get``,
``run_coroutine`` (the coroutine gets ``(this, node)`` as with ``hivemind.DHT``), ``get_visible_maddrs``,
``peer_id``, ``shutdown``, ``is_alive``/``join``. Never call it from inside a coroutine it runs (the loop
would wait on itself). Created by ``net.node.start_dht(in_process=True)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class InProcessDHT:
    """A ``DHTNode`` on an event loop thread; made stopped, ``start()`` starts it (``hivemind.DHT(start=False)``)."""

    def __init__(self, initial_peers: Sequence[str] = (), *, record_validators=(), **kwargs: Any) -> None:
        self.initial_peers = list(initial_peers)
        self.kwargs = kwargs  # forwarded to DHTNode.create and P2P.create, as hivemind.DHT does
        self._validators = list(record_validators)
        self._node = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._creating: concurrent.futures.Future | None = None  # the node's creation, held until done
        self._peer_id = None

    # ---- lifetime ------------------------------------------------------------------------------------
    def start(self) -> None:
        try:
            import uvloop  # hivemind's own DHT process runs on uvloop

            self._loop = uvloop.new_event_loop()
        except ImportError:
            self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dht-loop", daemon=True)
        self._thread.start()
        # held: the event loop keeps only weak references to its tasks, so a task whose awaited future nobody
        # else holds can be garbage-collected while pending ("Task was destroyed but it is pending!", then
        # GeneratorExit inside DHTNode.create: a fresh-clone suite run's bootstrap died of it)
        self._creating = asyncio.run_coroutine_threadsafe(self._create(), self._loop)

    async def _create(self) -> None:
        from hivemind.dht.node import DEFAULT_NUM_WORKERS, DHTNode
        from hivemind.dht.validation import CompositeValidator

        try:
            self._node = await DHTNode.create(
                initial_peers=self.initial_peers,
                num_workers=DEFAULT_NUM_WORKERS,
                record_validator=CompositeValidator(self._validators),
                **self.kwargs,
            )
        except BaseException as exc:
            logger.debug("the DHT node did not start: %r", exc)
            if not isinstance(exc, Exception):  # GeneratorExit, CancelledError: a start error to the caller
                exc = RuntimeError(f"the DHT node's start was interrupted: {exc!r}")
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Return once the node serves; raise ``TimeoutError`` or the node's start error."""
        self._ready.result(timeout=timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the node (and its p2pd), then the loop; idempotent."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return
        if self._node is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._node.shutdown(), loop).result(timeout)
            except Exception as exc:  # stopping must go on: the loop stops below whatever happened
                logger.warning("the DHT node did not shut down cleanly: %r", exc)
        loop.call_soon_threadsafe(loop.stop)
        self.join(timeout)
        if not self.is_alive():
            loop.close()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- calls (hivemind.DHT's signatures) -----------------------------------------------------------
    def _submit(self, call: Callable[[Any], Awaitable], return_future: bool):
        """Run ``call(node)`` on the loop: its future, or its result when ``return_future`` is false."""
        if self._node is None or self._loop is None or not self._loop.is_running():
            raise RuntimeError("the DHT node is not running")
        future = asyncio.run_coroutine_threadsafe(call(self._node), self._loop)
        return future if return_future else future.result()

    def store(self, key, value, expiration_time: float, subkey=None, return_future: bool = False, **kwargs):
        return self._submit(
            lambda node: node.store(key, value, expiration_time, subkey=subkey, **kwargs), return_future
        )

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        return self._submit(lambda node: node.get(key, latest=latest, **kwargs), return_future)

    def run_coroutine(self, coro: Callable[[InProcessDHT, Any], Awaitable], return_future: bool = False):
        return self._submit(lambda node: coro(self, node), return_future)

    def get_visible_maddrs(self, latest: bool = False) -> list:
        return self._submit(lambda node: node.get_visible_maddrs(latest=latest), False)

    @property
    def peer_id(self):
        return self._node.peer_id if self._node is not None else None
