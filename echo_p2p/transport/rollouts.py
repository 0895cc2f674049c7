"""Rollout transport between inference peers and trainers: the shared event loop and the public names.

Owned here: ``P2PLoop`` (a thread running an asyncio loop with this process's own connection to the DHT's
p2pd, where rollout servicers serve and rollout clients call), ``rollout_namespace`` (the RPC namespace of a
run) and the re-export of the transport's public classes:

- async push (``rollout_push``): ``RolloutIngestServicer`` (trainer) and ``RolloutPusher`` (inference peer);
- sync pull (``rollout_pull``): ``SampleServicer`` (inference peer) and ``SampleClient`` (trainer).

Threading model: the peers' own threads (sampling, training) call the synchronous APIs of ``RolloutPusher``
and ``SampleClient``; the networking runs in the ``P2PLoop`` thread; servicers run there too and hand every
blocking call (validation, sampling, weight updates) to worker threads so that the loop stays responsive.
Every wait has a deadline. Callers: the peers of both roles and tests. Must not import torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from echo_p2p.net.keys import SwarmKeys

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Largest serialized group a sender sends and a receiver parses (hivemind caps a message at 4 MiB).
from echo_p2p.transport.rollout_config import MAX_GROUP_BYTES  # noqa: E402,F401  (re-export)


def rollout_namespace(keys: SwarmKeys) -> str:
    """The RPC namespace of a run's rollout handlers (peers of two runs sharing a p2pd never mix)."""
    return f"echo-v{keys.protocol}-{keys.run_id}-rollouts"


class P2PLoop:
    """An asyncio loop in a daemon thread with its own replica of a running DHT's P2P daemon connection.

    Build it with ``P2PLoop.from_dht(dht)``. ``run(coro, timeout)`` runs a coroutine there from any other
    thread and waits at most ``timeout`` seconds (the coroutine is cancelled on timeout). A replica of its
    own (not ``dht.replicate_p2p()``, which is cached per process and bound to the loop that made it) lets
    several transports each run their own loop over the same p2pd.
    """

    def __init__(self, name: str = "echo-rollouts") -> None:
        self.loop = asyncio.new_event_loop()
        self.p2p = None  # hivemind.p2p.P2P, set by from_dht
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        self._dialed: set[str] = set()

    @classmethod
    def from_dht(cls, dht, timeout: float = 30.0, name: str = "echo-rollouts") -> P2PLoop:
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

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` in the loop and return its result; ``TimeoutError`` (and cancellation) after ``timeout``."""
        future = self.submit(_with_timeout(coro, timeout))
        try:
            return future.result(timeout + 5.0)  # the inner timeout fires first; this is the safety net
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout:.1f} s") from None

    async def dial(self, peer_id: str, maddrs: Iterable[str], timeout: float) -> None:
        """Dial ``peer_id`` at its announced addresses once (best effort: p2pd may also find it by itself)."""
        if peer_id in self._dialed or not maddrs:
            return
        from hivemind.utils.multiaddr import Multiaddr

        addrs = []
        for text in maddrs:
            try:
                addrs.append(Multiaddr(text))
            except Exception:  # a bad address in a record: skip it
                continue
        try:
            if addrs:
                await asyncio.wait_for(self.p2p._client.connect(peer_id_of(peer_id), addrs), timeout)
            self._dialed.add(peer_id)
        except Exception as exc:
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


def __getattr__(name: str) -> Any:  # lazy re-exports: importing this module stays cheap
    if name in ("RolloutIngestServicer", "RolloutPusher", "PusherConfig", "IngestServerConfig"):
        from echo_p2p.transport import rollout_push

        return getattr(rollout_push, name)
    if name in ("SampleServicer", "SampleClient", "SampleServerConfig", "SampleClientConfig", "SampleError"):
        from echo_p2p.transport import rollout_pull

        return getattr(rollout_pull, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
