"""A network lab for tests: Linux network namespaces wired as the internet our users are on.

- a **public segment**: one bridge (in a namespace of its own) that public hosts (a bootstrap, trainers,
  rented machines) and the home routers' WAN sides plug into, addresses ``11.77.0.0/24``. They must look
  globally routable: libp2p's AutoNAT never dials back, and its hole punching never starts from, a private
  address (10/8, 192.168/16, ...), so a lab on private ranges would test nothing of NAT traversal. No
  namespace of the lab has a route outside it: those addresses exist only between its own hosts;
- **home networks**: each a host namespace behind its own router namespace that masquerades (nftables NAT,
  no port forward) onto the public segment, with its uplink and downlink shaped by ``tc tbf``. Public hosts
  have no route into a home network: a home host can dial out, nobody can dial in, as behind a home router.

``tc`` here has ``tbf``/``htb`` but not ``netem``: links get bandwidth, not added latency or loss.

Processes started with ``NetLab.spawn`` run inside a host's namespace in a session of their own (a peer
forked from the lab's fork server when it has one); ``close``
stops them by process group and deletes every namespace the lab created, also when the test failed.
Needs root and ``ip`` (iproute2), ``nft`` (nftables) and ``tc``; ``skip_reason()`` says what is missing,
with the line that installs it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echo_p2p.forkserver import ForkServer

INSTALL = "apt-get install -y iproute2 nftables"
PUBLIC_NET = "11.77.0"


def skip_reason() -> str | None:
    """Why the lab cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, NAT)"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs {', '.join(missing)}: {INSTALL}"
    name = f"elprobe{uuid.uuid4().hex[:6]}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (in namespace ``ns``); raise with its stderr when it fails and ``check``."""
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done


@dataclass
class Host:
    """One machine of the lab: a namespace and the address others (or its router) see it at."""

    name: str
    ns: str
    address: str  # its own address (private for a home host)
    public_address: str  # the address the public segment sees its connections come from
    behind_nat: bool
    router_ns: str | None = None


@dataclass
class NetLab:
    """Namespaces, links and processes of one test (see the module doc). Use as a context manager."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    hosts: dict[str, Host] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    _numbers: itertools.count = field(default_factory=lambda: itertools.count(10))
    _homes: itertools.count = field(default_factory=lambda: itertools.count(1))
    _veths: itertools.count = field(default_factory=itertools.count)
    # an ``echo_p2p.forkserver.ForkServer``: peers (``python -m echo_p2p.peer``) are forked from it into their
    # host's namespace instead of importing torch & co. again (~5 CPU-s each); other commands, or all of
    # them when None or the helper failed, start as ``ip netns exec NS argv``
    forks: ForkServer | None = None

    def __enter__(self) -> NetLab:
        self.switch = self._namespace("sw")
        sh("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
        sh("ip", "link", "set", "br0", "up", ns=self.switch)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- building the network ----
    def _namespace(self, role: str) -> str:
        ns = f"el{self.tag}{role}"
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "set", "lo", "up", ns=ns)
        return ns

    def _plug_into_switch(self, ns: str, ifname: str, address: str) -> None:
        """A veth from ``ns`` (named ``ifname``, with ``address``/24) to the public bridge."""
        peer = f"v{self.tag}{next(self._veths)}"
        sh(
            "ip",
            "link",
            "add",
            ifname,
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            self.switch,
        )
        sh("ip", "link", "set", peer, "master", "br0", ns=self.switch)
        sh("ip", "link", "set", peer, "up", ns=self.switch)
        sh("ip", "addr", "add", f"{address}/24", "dev", ifname, ns=ns)
        sh("ip", "link", "set", ifname, "up", ns=ns)

    def public_host(self, name: str) -> Host:
        """A host with an address on the public segment: anyone can dial it."""
        ns = self._namespace(f"p{len(self.hosts)}")
        address = f"{PUBLIC_NET}.{next(self._numbers)}"
        self._plug_into_switch(ns, "eth0", address)
        host = Host(name, ns, address, address, behind_nat=False)
        self.hosts[name] = host
        return host

    def home_host(self, name: str, uplink_mbit: float | None = 20, downlink_mbit: float | None = 100) -> Host:
        """A host on a home network behind its own NAT router (masquerade, no port forward); the router's
        uplink and downlink are shaped to the given rates (None: not shaped)."""
        index = next(self._homes)
        router, ns = self._namespace(f"r{index}"), self._namespace(f"h{index}")
        wan = f"{PUBLIC_NET}.{100 + index}"
        self._plug_into_switch(router, "wan", wan)
        lan_net = f"192.168.{index}"
        sh("ip", "link", "add", "lan", "netns", router, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{lan_net}.1/24", "dev", "lan", ns=router)
        sh("ip", "link", "set", "lan", "up", ns=router)
        sh("ip", "addr", "add", f"{lan_net}.2/24", "dev", "eth0", ns=ns)
        sh("ip", "link", "set", "eth0", "up", ns=ns)
        sh("ip", "route", "add", "default", "via", f"{lan_net}.1", ns=ns)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=router)
        rules = (
            "add table ip nat\n"
            "add chain ip nat post { type nat hook postrouting priority 100 ; }\n"
            'add rule ip nat post oifname "wan" masquerade\n'
        )
        done = subprocess.run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft failed in {router}: {done.stderr.strip()}")
        if uplink_mbit:
            shape(router, "wan", uplink_mbit)
        if downlink_mbit:
            shape(router, "lan", downlink_mbit)
        host = Host(name, ns, f"{lan_net}.2", wan, behind_nat=True, router_ns=router)
        self.hosts[name] = host
        return host

    def sent_bytes(self, host: Host) -> int:
        """Bytes ``host`` has sent into the network so far (its ``eth0`` counter: everything its processes
        sent, relayed traffic included; a home host's, before its router's NAT and shaping)."""
        done = sh("cat", "/sys/class/net/eth0/statistics/tx_bytes", ns=host.ns)
        return int(done.stdout.strip())

    # ---- processes ----
    def spawn(
        self, host: Host, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``host``'s namespace, output to ``log``, in a session of its own."""
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        forked = (
            self.forks.spawn_argv(
                argv[1:], log=log, cwd=str(cwd) if cwd else None, env=full_env, netns=host.ns
            )
            if self.forks is not None and argv[0] == sys.executable
            else None
        )
        if forked is not None:
            self.procs.append(forked)  # type: ignore[arg-type]
            return forked  # type: ignore[return-value]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, *argv],
            cwd=str(cwd) if cwd else None,
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        """Signal ``proc``'s process group, wait up to ``grace`` s, then SIGKILL what is left of it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group's leftovers (p2pd, DHT child)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def close(self) -> None:
        """Stop every process the lab started, then delete every namespace (their links go with them)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for ns in reversed(self.namespaces):
            sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


def shape(ns: str, dev: str, mbit: float) -> None:
    """Limit what ``dev`` in ``ns`` sends to ``mbit`` Mbit/s (a token bucket, ~50 ms of queue)."""
    rate = f"{mbit}mbit"
    burst = f"{max(32, int(mbit * 1000 / 8 / 100))}kb"  # ~10 ms of traffic, at least 32 KB
    sh(
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        burst,
        "latency",
        "50ms",
        ns=ns,
    )


def can_connect(host: Host, address: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connection from ``host`` to ``address:port`` is accepted (there is no ping here)."""
    code = (
        "import socket,sys\n"
        "s=socket.socket();s.settimeout(float(sys.argv[3]))\n"
        "sys.exit(0 if s.connect_ex((sys.argv[1],int(sys.argv[2])))==0 else 1)\n"
    )
    done = subprocess.run(
        ["ip", "netns", "exec", host.ns, "python3", "-c", code, address, str(port), str(timeout)],
        capture_output=True,
        timeout=timeout + 10,
    )
    return done.returncode == 0
