"""Starting and stopping a hivemind DHT node with echo_p2p's validators, identity and deadlines.

Owned here: turning a ``NetworkConfig`` + ``Identity`` into a running ``hivemind.DHT`` whose records are
signed with the identity's key and validated against the run's schema; checking that listening ports
are free (p2pd binds with SO_REUSEPORT and would silently share a busy port); bounded start-up with clear
errors for unreachable initial peers (tried again every ``JOIN_RETRY`` s until the deadline: a bootstrap may
be starting or restarting); reading the node's visible addresses and neighbour counts.
Callers: the bootstrap, the peers and the swarm CLI. No torch.nn.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Sequence

from echo_p2p.net.identity import Identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.network_config import NetworkConfig

logger = logging.getLogger(__name__)

#: Seconds between two attempts to join when no initial peer answered (until the start-up deadline).
JOIN_RETRY = 1.0


class NodeStartError(RuntimeError):
    """The DHT node could not start or join: the message says why, in words a user can act on."""


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Raise NodeStartError if a fixed TCP port of ``host_maddrs`` is already bound by another process."""
    for maddr in host_maddrs:
        parts = maddr.split("/")
        if "tcp" not in parts:
            continue
        port = int(parts[parts.index("tcp") + 1])
        if port == 0:
            continue
        host, family = "0.0.0.0", socket.AF_INET
        if "ip4" in parts:
            host = parts[parts.index("ip4") + 1]
        elif "ip6" in parts:
            host, family = parts[parts.index("ip6") + 1], socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise NodeStartError(
                        f"port {port} on {host} is already in use (another bootstrap or peer?): "
                        f"choose another with --host-maddrs /ip4/{host}/tcp/PORT"
                    ) from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise NodeStartError(
                        f"cannot listen on {host}: no such local address ({maddr})"
                    ) from None
                raise NodeStartError(f"cannot listen on {maddr}: {exc.strerror}") from None


def start_dht(
    network: NetworkConfig,
    identity: Identity,
    run_keys: Sequence[SwarmKeys] = (),
    *,
    client_mode: bool = False,
    in_process: bool = False,
):
    """Start a ``hivemind.DHT`` in a child process, or with ``in_process`` an ``InProcessDHT`` (a node in this
    process: no torch, for a process that does not train); raise ``NodeStartError`` within the startup
    deadline."""
    from hivemind.dht.crypto import RSASignatureValidator

    from echo_p2p.net.reachability import daemon_options
    from echo_p2p.net.records import rules_validator, schema_validator
    from echo_p2p.net.sockets import use_private_socket_dir
    from echo_p2p.net.trainer_writers import TrainerWriters, trainer_keys

    if not client_mode:
        check_ports_free(network.host_maddrs)
    validators = [RSASignatureValidator(identity.private_key)]
    validators += [schema_validator(keys) for keys in run_keys]
    validators += [rules_validator(keys) for keys in run_keys]
    # open until the peer tells it the run's trainers and owner (SwarmDirectory.follow_trust)
    validators += [TrainerWriters(trainer_keys(keys), keys.run) for keys in run_keys]
    kwargs = dict(
        initial_peers=list(network.initial_peers),
        host_maddrs=list(network.host_maddrs),
        identity_path=identity.path,
        record_validators=validators,
        client_mode=client_mode,
        start=False,
        await_ready=False,
        # a fresh identity cannot be taken; a persistent one is checked by hivemind (a second process
        # with the same identity file would split the swarm's view of this peer)
        check_if_identity_free=not identity.ephemeral,
    )
    if network.announce_maddrs:
        kwargs["announce_maddrs"] = list(network.announce_maddrs)
    # a reader (monitor, swarm status) dials out only: it needs no relay slot of its own
    kwargs.update(daemon_options(() if client_mode else network.relay_addresses, network.reachability))
    make = _dht_maker(in_process)  # imports first (torch, for hivemind.DHT): not on the start-up deadline
    use_private_socket_dir()  # this process's p2pd and client sockets: removed when it exits
    deadline = time.monotonic() + network.startup_timeout
    knock_deadline = min(deadline, time.monotonic() + network.knock_timeout)
    said = False  # the reason is logged once, not on every knock
    try:
        while True:
            dht = make(kwargs)
            dht.start()
            try:
                dht.wait_until_ready(timeout=max(0.1, deadline - time.monotonic()))
                return dht
            except TimeoutError:
                _kill(dht)
                raise NodeStartError(
                    f"the DHT node did not start within {network.startup_timeout:.0f} s; "
                    f"initial peers: {', '.join(network.initial_peers) or 'none'}"
                ) from None
            except Exception as exc:
                _kill(dht)
                message = _explain_start_error(exc, network)
                # a bootstrap that is (re)starting: keep knocking until the knock deadline
                if not _no_initial_peer_answered(exc) or time.monotonic() + JOIN_RETRY >= knock_deadline:
                    raise NodeStartError(message) from None
                if not said:
                    said = True
                    logger.info(
                        "%s; trying again every %.0f s for %.0f s", message, JOIN_RETRY, network.knock_timeout
                    )
                time.sleep(JOIN_RETRY)
    finally:
        # the daemon has read an ephemeral key file by now (or is gone): remove it, so that no private key
        # outlives a peer that is killed before its shutdown runs
        identity.cleanup()


def _dht_maker(in_process: bool):
    """What makes a DHT, not started, from ``start_dht``'s keyword arguments: an ``InProcessDHT``, or a
    ``hivemind.DHT`` with its pipe guarded. Imports the class now (with ``net.lean_hivemind``, the import of
    ``hivemind.DHT`` is the one that brings torch)."""
    if in_process:
        from echo_p2p.net.inprocess_dht import InProcessDHT

        return lambda kwargs: InProcessDHT(
            **{k: v for k, v in kwargs.items() if k not in ("start", "await_ready")}
        )
    from hivemind.dht.dht import DHT

    def make(kwargs: dict):
        dht = DHT(**kwargs)
        _guard_pipes(dht)
        return dht

    return make


class _LockedSender:
    """The sending end of the DHT's command pipe, one whole message at a time across threads *and* forked
    processes (hivemind's averagers are forked children that send on the same pipe): a message above the
    pipe's atomic size is written in pieces, and two writers interleaving them corrupt the stream."""

    def __init__(self, conn) -> None:
        import multiprocessing as mp

        self._conn = conn
        self._lock = mp.get_context("fork").Lock()  # a semaphore shared with forked children

    def send(self, obj) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name):
        return getattr(self._conn, name)


class _WholeMessageReceiver:
    """The receiving end in the DHT's child: its event loop watches the pipe with libuv, which makes the
    descriptor non-blocking, so a ``recv`` that starts before the sender has written the whole message
    fails half-way (EAGAIN, which hivemind logs and skips) and leaves the rest of the message in the
    pipe, to be read as the start of the next one. Receiving in blocking mode reads whole messages.

    A whole message that cannot be unpickled is dropped, not raised: every command carries an ``MPFuture``
    whose pipe end is unpickled by fetching the descriptor from the *sender's* process, and a sender that
    exited meanwhile (an averager child at ``optimizer.shutdown``) made that fail with ``EOFError`` and
    killed the DHT child; every later DHT call of the peer then waited forever (seen in the lone-trainer
    test, 1 fresh-clone run in 2). Nobody waits for that command's answer: its sender is gone."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self.dropped = 0

    def recv(self):
        import os
        from multiprocessing.reduction import ForkingPickler

        os.set_blocking(self._conn.fileno(), True)
        while True:
            buf = self._conn.recv_bytes()  # a whole message, or EOFError when every sender is gone
            try:
                return ForkingPickler.loads(buf)
            except Exception as exc:
                self.dropped += 1
                logger.warning("the DHT dropped a command it could not unpickle (sender gone?): %r", exc)

    def __getattr__(self, name):
        return getattr(self._conn, name)


def _guard_pipes(dht) -> None:
    """Make a not-yet-started ``hivemind.DHT``'s command pipe safe for concurrent senders (hivemind 1.1's
    pipe is not: under several threads storing large records, the DHT child died with an
    ``UnpicklingError`` or ``EOFError`` and every later DHT call of the peer waited forever)."""
    dht._outer_pipe = _LockedSender(dht._outer_pipe)
    dht._inner_pipe = _WholeMessageReceiver(dht._inner_pipe)


def _no_initial_peer_answered(exc: Exception) -> bool:
    """hivemind's and p2pd's errors when no initial peer answers ("failed to connect to bootstrap peers",
    "DHTNode bootstrap failed") all name the bootstrap."""
    return "bootstrap" in str(exc).lower()


#: hivemind's refusal of a node whose clock is off the initial peers' (``DHTProtocol.call_ping``).
_CLOCK_SKEW_RE = re.compile(r"local time must be within .*local: ([0-9.]+), peer: ([0-9.]+)")


def _explain_start_error(exc: Exception, network: NetworkConfig) -> str:
    text = str(exc)
    if _no_initial_peer_answered(exc):
        return (
            f"none of the initial peers answered within {min(network.knock_timeout, network.startup_timeout):.0f} s: "
            + ", ".join(network.initial_peers)
            + " (is the bootstrap running, its TCP port open to this machine, and the address complete with its "
            "/p2p/ part? --knock-timeout S waits longer for a bootstrap that is starting)"
        )
    skew = _CLOCK_SKEW_RE.search(text)
    if skew:
        local, peer = float(skew.group(1)), float(skew.group(2))
        return (
            f"this machine's clock is {local - peer:+.0f} s off the bootstrap's (here "
            f"{time.strftime('%H:%M:%S', time.gmtime(local))} UTC, there {time.strftime('%H:%M:%S', time.gmtime(peer))} "
            "UTC) and DHT nodes must agree within a few seconds: set the clock (e.g. timedatectl set-ntp true)"
        )
    if "already taken" in text:
        return f"{text}: another running peer uses this identity file; give each peer its own --identity-path"
    if "address already in use" in text.lower():
        return f"a listening port is already in use ({', '.join(network.host_maddrs)})"
    return f"the DHT node failed to start: {text.strip().splitlines()[-1] if text.strip() else type(exc).__name__}"


def _kill(dht) -> None:
    try:
        dht.shutdown()
    except Exception:  # the child may already be gone
        pass
    _reap(dht)


def _reap(dht) -> None:
    """Make sure the DHT's child process is gone: SIGTERM, then SIGKILL (a child that ignores SIGTERM would
    otherwise keep our process from exiting, since multiprocessing joins its children at exit)."""
    if not hasattr(dht, "terminate"):  # an InProcessDHT: no process; its shutdown stopped its thread
        return
    if dht.is_alive():
        dht.terminate()
        dht.join(timeout=5)
    if dht.is_alive():
        logger.warning("the DHT process ignored SIGTERM; killing it")
        dht.kill()
        dht.join(timeout=5)


def stop_dht(dht, timeout: float = 10.0) -> None:
    """Shut the DHT child process (and its p2pd) down; never hangs longer than ``timeout``."""
    if not call_with_deadline(dht.shutdown, timeout, "dht-shutdown") and dht.is_alive():
        logger.warning("DHT did not shut down within %.0f s; terminating its process", timeout)
    try:
        _reap(dht)
    except (AssertionError, AttributeError):  # not a started process (e.g. a replica): nothing to reap
        pass


def call_with_deadline(fn, timeout: float, name: str) -> bool:
    """Run ``fn()`` in a daemon thread; True if it returned (or raised, logged) within ``timeout`` seconds."""
    done = threading.Event()

    def _run() -> None:
        try:
            fn()
        except Exception:  # stopping must never fail: the caller falls back to harsher means
            logger.debug("%s raised", name, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=_run, name=name, daemon=True).start()
    return done.wait(timeout)


def visible_maddrs(dht) -> list[str]:
    """Addresses others can dial, with the /p2p/ part; wildcard listens are left out."""
    out = []
    for maddr in dht.get_visible_maddrs():
        text = str(maddr)
        parts = text.split("/")
        if "ip4" in parts and ipaddress.ip_address(parts[parts.index("ip4") + 1]).is_unspecified:
            continue
        out.append(text)
    return out


#: Most peers a rejoin pings at once (the run's bootstraps, the peers remembered, the peers connected).
MAX_REJOIN_PINGS = 32


def rejoin_dht(dht, maddrs: Sequence[str], timeout: float) -> tuple[int, int]:
    """Refill an empty DHT routing table: ping the peers at ``maddrs`` (dialed first: the run's bootstraps,
    the peers remembered) and every peer with an open libp2p connection, then look up this node's own
    neighbourhood. Returns (peers that answered, peers in the routing table now).

    Why: hivemind drops peers that do not answer from the routing table, and nothing refills an empty one (its
    periodic refresh asks the peers in the table). A trainer cut off for 37 s in the chaos soak lost every
    neighbour and stayed alone for 27 minutes with 7 libp2p connections open: its records stored only by
    itself, never reading the other trainer's. Raises ``TimeoutError`` after ``timeout`` + 2 s."""
    import functools

    call = functools.partial(_rejoin, maddrs=list(maddrs)[:MAX_REJOIN_PINGS], timeout=timeout)
    return dht.run_coroutine(call, return_future=True).result(timeout=timeout + 2.0)


async def _rejoin(_dht, node, maddrs: list[str], timeout: float) -> tuple[int, int]:
    # runs inside the DHT's child process (pickled there): module-level, standard and hivemind imports only
    from hivemind.p2p import PeerID

    from echo_p2p.net.reachability import daemon_maddr

    targets: dict = {}
    for text in maddrs:
        try:
            peer = PeerID.from_base58(text.rsplit("/p2p/", 1)[1])  # the target, after any relay's part
            targets.setdefault(peer, []).append(daemon_maddr(text))
        except Exception:  # an address without /p2p/ or a bad one: nobody to ping there
            continue
    try:
        for info in await asyncio.wait_for(node.p2p.list_peers(), timeout):
            targets.setdefault(info.peer_id, [])
    except Exception as exc:
        logger.debug("listing the connected peers failed: %r", exc)
    targets.pop(node.peer_id, None)

    async def ping(peer, addrs) -> bool:
        if addrs:
            try:
                await asyncio.wait_for(node.p2p._client.connect(peer, addrs), timeout)
            except Exception:  # not reachable there now: the ping says whether it is reachable at all
                pass
        try:  # call_ping adds a peer that answers to the routing table
            return await asyncio.wait_for(node.protocol.call_ping(peer), timeout) is not None
        except Exception:
            return False

    chosen = list(targets.items())[:MAX_REJOIN_PINGS]
    answered = sum(await asyncio.gather(*(ping(peer, addrs) for peer, addrs in chosen)))
    if answered:
        try:  # as hivemind's own bootstrap does: find this node's nearest neighbours through those
            await asyncio.wait_for(node.find_nearest_nodes([node.node_id]), timeout)
        except Exception as exc:
            logger.debug("looking up the neighbourhood after a rejoin failed: %r", exc)
    return answered, len(node.protocol.routing_table.peer_id_to_uid)


#: Seconds the libp2p daemon gets to list its open connections for ``neighbour_counts``. It has left that call
#: unanswered for more than 10 s on a loaded machine (the client's request timeout): a trainer's heartbeat
#: was held that long, and its publisher election with it (a CI failover took 15.6 s where 3-5 s is usual).
#: The routing table's size needs no daemon call and comes back whatever the daemon does.
LIST_PEERS_TIMEOUT = 2.0


def neighbour_counts(dht, timeout: float = 5.0, connections: bool = True) -> tuple[int, int]:
    """(peers in the DHT routing table, peers with an open libp2p connection). Connections are -1 when not
    asked for (``connections=False``: no call to the libp2p daemon) or when the daemon did not list them
    within ``LIST_PEERS_TIMEOUT`` (at most half of ``timeout``)."""
    wait = min(LIST_PEERS_TIMEOUT, timeout / 2) if connections else None
    count = functools.partial(_count_neighbours, list_timeout=wait)
    return dht.run_coroutine(count, return_future=True).result(timeout=timeout)


async def _count_neighbours(_dht, node, list_timeout: float | None = None) -> tuple[int, int]:
    # runs inside the DHT's child process: a module-level function (pickled there, with its argument)
    table = len(node.protocol.routing_table.peer_id_to_uid)
    if list_timeout is None:
        return table, -1
    try:
        connected = len(await asyncio.wait_for(node.p2p.list_peers(), list_timeout))
    except asyncio.TimeoutError:
        logger.debug("the libp2p daemon did not list its connections within %.1f s", list_timeout)
        connected = -1
    return table, connected
