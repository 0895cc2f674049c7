"""How others reach this node: which of its addresses to announce, and whether it is reachable at all.

Owned here: classifying multiaddrs (loopback, private, public, relayed), the swarm's *scope* (the class of its
bootstrap addresses: a run on 127.0.0.1, on a LAN, or on the internet), ``dialable`` (the addresses worth
announcing in that scope), ``Reachability`` (a node's current status and addresses, re-read from its daemon
at most every few seconds), the p2pd flags of every node (``daemon_options``: bounded relay buffers, and
what makes a node behind NAT reachable through relays), and ``daemon_maddr`` (an announced address as the
daemon dials it).
Callers: ``net.node.start_dht``, the peers' announcements, the weights provider and publisher,
``transport.p2p_loop``. No hivemind import at module level.

Behind a NAT (docs/protocol.md, "Reachability")
-------------------------------------------------
Every node that knows a bootstrap runs p2pd with AutoNAT and *static* relays (the bootstraps, or
``network.relays``): once AutoNAT finds the node unreachable (other nodes' dial-backs fail), it reserves a
slot on a relay at once and its addresses gain ``<relay>/p2p-circuit``. (With relay discovery instead of
static relays, go-libp2p waits for 4 candidates or 3 minutes before reserving.) A node announces only
addresses that others in the swarm's scope can dial: on the internet, its public addresses, else its relayed
ones, else none — never loopback or private ones, which made every fetch from a home peer pay failed dials.
A node with no address to announce is ``unreachable``: it does not offer itself as a chunk provider.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

AddressClass = Literal["loopback", "private", "public", "relayed"]
Status = Literal["direct", "relayed", "unreachable"]
RANK = {"loopback": 0, "private": 1, "public": 2}

#: hivemind 1.1.12 passes ``force_reachability`` through a class table of p2pd flags: echo_p2p registers its
#: own entries there (``daemon_options``), the only way to hand p2pd flags that ``P2P.create`` does not name.
_MODE_FLAGS = {None: {}, "public": {"forceReachabilityPublic": 1}, "private": {"forceReachabilityPrivate": 1}}

#: Bytes of each of the two buffers through which p2pd's relay service copies one relayed connection.
#: hivemind's p2pd defaults to 16 MiB (go-libp2p's own default is 2 KiB): 32 MiB of a relay's memory per
#: circuit, up to 16 circuits per peer. A bootstrap relaying the swarm's home peers grew by tens of MiB at
#: every reconnection in the soak (docs/reliability.md), and a stranger could make it hold 512 MiB per key.
#: 64 KiB copies a relayed stream in 64 KiB reads, far above a home uplink's need.
RELAY_BUFFER_BYTES = 64 * 1024


def address_class(maddr: str) -> AddressClass | None:
    """The class of one multiaddr; None for one that nobody can dial (unspecified, unparsable)."""
    if "/p2p-circuit" in maddr:
        return "relayed"
    parts = maddr.split("/")
    for proto in ("ip4", "ip6"):
        if proto in parts:
            try:
                ip = ipaddress.ip_address(parts[parts.index(proto) + 1])
            except (ValueError, IndexError):
                return None
            if ip.is_unspecified:
                return None
            if ip.is_loopback:
                return "loopback"
            return "public" if ip.is_global else "private"
    if any(proto in parts for proto in ("dns", "dns4", "dns6", "dnsaddr")):
        return "public"
    return None


def swarm_scope(initial_peers: Iterable[str]) -> AddressClass | None:
    """Where the swarm lives, from its bootstrap addresses: ``public`` (the internet), ``private`` (a LAN)
    or ``loopback`` (one machine); None without bootstraps (a bootstrap itself, or a lone node)."""
    ranks = [RANK[c] for c in map(address_class, initial_peers) if c in RANK]
    if not ranks:
        return None
    return next(name for name, rank in RANK.items() if rank == max(ranks))


def dialable(maddrs: Sequence[str], scope: AddressClass | None) -> tuple[list[str], Status]:
    """The addresses worth announcing in ``scope`` and the status they give (see the module doc).

    ``scope`` None (no bootstrap known): the node's own best class is the scope."""
    by_class: dict[str, list[str]] = {"loopback": [], "private": [], "public": [], "relayed": []}
    for maddr in maddrs:
        cls = address_class(maddr)
        if cls is not None:
            by_class[cls].append(maddr)
    if scope is None:
        scope = next((c for c in ("public", "private", "loopback") if by_class[c]), "public")
    direct = [m for c, rank in RANK.items() if rank >= RANK[scope] for m in by_class[c]]
    if scope == "public":
        if by_class["public"]:
            return by_class["public"], "direct"
        if by_class["relayed"]:
            return by_class["relayed"], "relayed"
        return [], "unreachable"
    if direct:
        return direct, "direct"
    return (by_class["relayed"], "relayed") if by_class["relayed"] else ([], "unreachable")


def daemon_options(relays: Sequence[str], reachability: str) -> dict:
    """Extra ``hivemind.DHT`` / ``P2P.create`` arguments of every node: p2pd's relay service with bounded
    buffers (``RELAY_BUFFER_BYTES``), AutoNAT's verdict (or ``reachability`` forced to ``public``/``private``)
    and, when ``relays`` are known, a reservation on one of them as soon as the node is found unreachable
    (relay discovery off: static relays reserve at once)."""
    from hivemind.p2p import P2P

    forced = None if reachability == "auto" else reachability
    flags = {**_MODE_FLAGS[forced], "relayBufferSize": RELAY_BUFFER_BYTES}
    name = f"echo-{forced or 'auto'}"
    options: dict = {}
    if relays:
        flags["relayDiscovery"] = 0
        name += "-static-relays"
        options = {"use_relay": True, "use_auto_relay": True, "trusted_relays": list(relays)}
    P2P.FORCE_REACHABILITY_MAPPING.setdefault(name, flags)
    return {**options, "force_reachability": name}


def daemon_maddr(maddr: str):
    """An announced address (``.../p2p/<target>``) as the daemon dials it: without the target's own
    ``/p2p/`` part, and with a relay's peer id encoded as the raw multihash go-libp2p reads (the Python
    multiaddr library writes a CID there, which p2pd refuses: "length greater than remaining bytes")."""
    import base58
    from hivemind.utils.multiaddr import Multiaddr

    head = maddr.rsplit("/p2p/", 1)[0] if maddr.count("/p2p/") else maddr
    if "/p2p-circuit" not in head:
        return Multiaddr(head)
    relay, _, tail = head.partition("/p2p-circuit")
    transport, _, relay_id = relay.rpartition("/p2p/")
    if not transport or not relay_id or tail:
        raise ValueError(f"not a relayed address: {maddr}")
    digest = base58.b58decode(relay_id)
    if len(digest) > 127:
        raise ValueError(f"peer id too long in {maddr}")
    raw = Multiaddr(transport).to_bytes() + bytes([0xA5, 0x03, len(digest)]) + digest + bytes([0xA2, 0x02])
    return Multiaddr(raw)


@dataclass
class Reachability:
    """A node's announced addresses and status, re-read from its daemon at most every ``period`` s
    (AutoNAT's verdict and a relay reservation arrive some seconds after start), and at most every ``retry``
    s while it is unreachable: a node whose first read failed or found no address yet (its daemon just
    started) held itself unreachable for a whole period, and a weight receiver that fetched a version in
    0.15 s stored no provider record for 5 s, while the others waited for the chunks it held (a crowd-fetch
    test under load served the version 3x from the publisher)."""

    dht: object
    initial_peers: Sequence[str] = ()
    period: float = 5.0
    retry: float = 0.5
    maddrs: list[str] = field(default_factory=list)
    status: Status = "unreachable"
    _read_at: float = -float("inf")
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.scope = swarm_scope(self.initial_peers)

    def current(self) -> tuple[list[str], Status]:
        """``(addresses to announce, status)``, refreshed when older than ``period`` (``retry`` while
        unreachable)."""
        with self._lock:
            every = min(self.period, self.retry) if self.status == "unreachable" else self.period
            if time.monotonic() - self._read_at >= every:
                self._read_at = time.monotonic()
                try:
                    own = [str(m) for m in _visible_maddrs(self.dht, timeout=self.period)]
                except Exception:  # the daemon is busy or gone: keep what we knew
                    return list(self.maddrs), self.status
                self.maddrs, self.status = dialable(own, self.scope)
            return list(self.maddrs), self.status


def _visible_maddrs(dht, timeout: float) -> list:
    """The node's own addresses as its daemon has them now (``hivemind.DHT.get_visible_maddrs(latest=True)``
    with a deadline; that method has none)."""
    from functools import partial

    from hivemind import DHT

    future = dht.run_coroutine(partial(DHT._get_visible_maddrs, latest=True), return_future=True)
    return future.result(timeout=timeout)
