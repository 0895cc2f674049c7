"""A node's network settings (``NetworkConfig``) and the multiaddr syntax check every config uses.

Owned here so that the networking layer's settings sit with it (``net.node`` reads them without importing
``echo_p2p.config``); ``echo_p2p.config`` uses ``NetworkConfig`` as part of a peer's and a bootstrap's
configuration, and everything imports it from here. No hivemind import: config parsing
must stay instant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from echo_p2p.paths import UserPath

_MADDR_PROTOCOLS = {  # protocol -> takes a value
    "ip4": True,
    "ip6": True,
    "dns": True,
    "dns4": True,
    "dns6": True,
    "dnsaddr": True,
    "tcp": True,
    "udp": True,
    "p2p": True,
    "ipfs": True,
    "quic": False,
    "quic-v1": False,
    "ws": False,
    "wss": False,
    "p2p-circuit": False,
    "tls": False,
    "noise": False,
}


def check_maddr(value: str, *, need_peer_id: bool = False) -> str:
    """Light syntax check of a multiaddr (no hivemind import: config parsing must stay instant)."""
    import ipaddress

    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{value!r} is not a multiaddr (expected e.g. /ip4/203.0.113.5/tcp/31337/p2p/Qm...)")
    parts = value.split("/")[1:]
    names = []
    i = 0
    while i < len(parts):
        name = parts[i]
        if name not in _MADDR_PROTOCOLS:
            raise ValueError(f"{value!r} is not a multiaddr: unknown protocol {name!r}")
        names.append(name)
        if _MADDR_PROTOCOLS[name]:
            if i + 1 >= len(parts) or not parts[i + 1]:
                raise ValueError(f"{value!r} is not a multiaddr: /{name} needs a value")
            arg = parts[i + 1]
            try:
                if name == "ip4":
                    ipaddress.IPv4Address(arg)
                elif name == "ip6":
                    ipaddress.IPv6Address(arg)
                elif name in ("tcp", "udp") and not 0 <= int(arg) <= 65535:
                    raise ValueError("port out of range")
            except ValueError as exc:
                raise ValueError(f"{value!r} is not a multiaddr: bad /{name} value {arg!r} ({exc})") from None
            i += 2
        else:
            i += 1
    if need_peer_id and not ({"p2p", "ipfs"} & set(names)):
        raise ValueError(f"{value!r} has no /p2p/<peer id> part: copy the full address the bootstrap printed")
    return value


class NetworkConfig(BaseModel):
    """How a node joins the swarm: addresses, identity, reachability and deadlines."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    initial_peers: list[str] = Field(
        default_factory=list, description="Multiaddrs of known peers (a bootstrap), each ending in /p2p/<id>"
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="Multiaddrs to listen on"
    )
    announce_maddrs: list[str] = Field(
        default_factory=list,
        description="Multiaddrs others should dial (e.g. a public IP behind port forwarding)",
    )
    identity_path: UserPath | None = Field(
        default=None, description="Private key file; created when missing; keeps the peer id across restarts"
    )
    reachability: Literal["auto", "public", "private"] = Field(
        default="auto",
        description="auto: AutoNAT finds out whether others can dial this node (behind a NAT it then reserves "
        "a slot on a relay and announces its relayed address); public/private: say so instead",
    )
    relays: list[str] | None = Field(
        default=None,
        description="Relays (multiaddrs with /p2p/<id>) a node behind NAT is reached through; None: the "
        "initial peers; []: none",
    )
    startup_timeout: float = Field(default=30.0, gt=0, le=600, description="Deadline (s) to start and join")
    knock_timeout: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="Seconds to keep dialing initial peers that do not answer (a bootstrap that is starting) "
        "before giving up with the reason; within startup_timeout",
    )
    request_timeout: float = Field(
        default=10.0, gt=0, le=300, description="Deadline (s) of one DHT read/write"
    )

    @field_validator("initial_peers")
    @classmethod
    def _initial_peers(cls, value: list[str]) -> list[str]:
        return [check_maddr(v, need_peer_id=True) for v in value]

    @field_validator("relays")
    @classmethod
    def _relays(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [check_maddr(v, need_peer_id=True) for v in value]

    @property
    def relay_addresses(self) -> list[str]:
        """The relays a node behind NAT uses (``relays``, else the initial peers)."""
        return list(self.initial_peers if self.relays is None else self.relays)

    @field_validator("host_maddrs", "announce_maddrs")
    @classmethod
    def _maddrs(cls, value: list[str]) -> list[str]:
        return [check_maddr(v) for v in value]
