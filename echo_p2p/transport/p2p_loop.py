"""``P2PLoop``: one thread running an asyncio loop with this process's own connection to the DHT's p2pd.

Owned here: the event loop that the transports' servicers serve on and their clients call from (the weights
endpoint and the rollout transport each run one over the same p2pd), running coroutines on it from
synchronous threads with a deadline, dialing peers at their announced addresses, and ``peer_id_of``.
Threading model: the peers' own threads (sampling, training) call synchronous APIs; the networking runs in
the loop thread; servicers hand every blocking call to worker threads so that the loop stays responsive.
Callers: ``weights.service``, ``rollouts.ingest``, ``rollouts.push``, ``rollouts.pull``, ``rollouts.sample``, the peers, tests. Must not import torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class P2PLoop:
    """An asyncio loop in a daemon thread with its own replica of a running DHT's P2P daemon connection.

    Build it with ``P2PLoop.from_dht(dht)``. ``run(coro, timeout)`` runs a coroutine there from any other
    thread and waits at most ``timeout`` seconds (the coroutine is cancelled on timeout). A replica of its
    own (not ``dht.replicate_p2p()``, which is cached per process and bound to the loop that made it) lets
    several transports each run their own loop over the same p2pd.
    """

    def __init__(self, name: str = "echo-p2p-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.p2p = None  # hivemind.p2p.P2P, set by from_dht
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        self._dialed: set[str] = set()

    @classmethod
    def from_dht(cls, dht, timeout: float = 30.0, name: str = "echo-p2p-loop") -> P2PLoop:
        """Start the loop and connect it to ``dht``'s p2pd (``TimeoutError`` after ``timeout`` s)."""
        from hivemind.dht.dht import DHT

        self = cls(name)
        try:
            maddr = dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr, return_future=True).result(timeout)
            self.p2p = self.run(_replicate(maddr), timeout=timeout)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def peer_id(self) -> str:
        """This node's peer id (base58)."""
        return self.p2p.peer_id.to_base58()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` in the loop; returns a thread-safe future."""
        if self._closed:
            coro.close()
            raise RuntimeError("P2PLoop is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, stop: threading.Event | None = None) -> T:
        """Run ``coro`` in the loop and return its result; ``TimeoutError`` (and cancellation) after ``timeout``.
        With ``stop``: cancelled within 0.1 s of ``stop`` being set (``concurrent.futures.CancelledError``),
        so that a peer asked to stop does not first wait out a long call."""
        future = self.submit(_with_timeout(coro, timeout))
        end = time.monotonic() + timeout + 5.0  # the inner timeout fires first; this is the safety net
        try:
            while True:
                try:
                    return future.result(0.1 if stop is not None else timeout + 5.0)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the coroutine's own timeout, not the wait's
                        raise
                    if stop is not None and stop.is_set():
                        future.cancel()
                        raise concurrent.futures.CancelledError("stop requested") from None
                    if time.monotonic() >= end:
                        raise
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout:.1f} s") from None

    async def dial(self, peer_id: str, maddrs: Iterable[str], timeout: float, strict: bool = False) -> None:
        """Dial ``peer_id`` at its announced addresses once. Best effort (p2pd may also find it by itself);
        with ``strict`` a failed dial raises, so that the caller can count it against that peer."""
        if peer_id in self._dialed or peer_id == self.peer_id:
            return
        from echo_p2p.net.reachability import daemon_maddr

        addrs = []
        for text in maddrs:
            try:  # the daemon dials transport (or relayed) addresses, without the target's /p2p/ part
                addrs.append(daemon_maddr(text))
            except Exception:  # a bad address in a record: skip it
                continue
        if not addrs:  # nothing to dial (yet): p2pd may know the peer; a later call with addresses dials
            return
        try:
            await asyncio.wait_for(self.p2p._client.connect(peer_id_of(peer_id), addrs), timeout)
            self._dialed.add(peer_id)
        except Exception as exc:
            if strict:
                raise
            logger.debug("dialing %s failed: %s", peer_id, exc)

    def forget(self, peer_id: str) -> None:
        """Dial ``peer_id`` again next time (after a failed call)."""
        self._dialed.discard(peer_id)

    def add_servicer(self, servicer, namespace: str | None, timeout: float = 10.0) -> None:
        """Register ``servicer``'s ``rpc_*`` handlers on this loop's P2P under ``namespace``."""
        self.run(servicer.add_p2p_handlers(self.p2p, namespace=namespace), timeout=timeout)

    def remove_servicer(self, servicer, namespace: str | None, timeout: float = 10.0) -> None:
        self.run(servicer.remove_p2p_handlers(self.p2p, namespace=namespace), timeout=timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Close the P2P replica (p2pd itself belongs to the DHT) and stop the loop; idempotent."""
        if self._closed:
            return
        if self.loop.is_running():
            try:
                self.run(_close(self.p2p, timeout), timeout=timeout + 1.0)
            except Exception:  # the daemon may be gone already; stopping must never fail
                logger.debug("closing the P2P replica failed", exc_info=True)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


async def _close(p2p, timeout: float) -> None:
    """Cancel every other task of the loop (handlers, calls in flight), then close the P2P replica."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
    if p2p is not None:
        await p2p.shutdown()


async def _replicate(maddr):
    from hivemind.p2p import P2P

    return await P2P.replicate(maddr)


async def _with_timeout(coro: Coroutine[Any, Any, T], timeout: float) -> T:
    return await asyncio.wait_for(coro, timeout=timeout)


def peer_id_of(base58: str):
    """``hivemind.p2p.PeerID`` of a base58 peer id (``ValueError`` when it does not parse)."""
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_base58(base58)
    except Exception as exc:
        raise ValueError(f"bad peer id {base58[:64]!r}") from exc
