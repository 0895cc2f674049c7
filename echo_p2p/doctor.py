"""``python -m echo_p2p.doctor --join ADDRESS``: walk each hop of a join and name the first that fails.

A donor whose peer does not train cannot see where the chain breaks. The doctor joins the run's DHT as a
node that listens as a peer would (on ``--host-maddrs``) and checks, in order, each hop a peer depends on, with a bounded
deadline each: the **bootstrap** answers; this machine's **clock** agrees with the bootstrap's; a **run
record** signed by the address's owner is there (``run_record.explain_missing`` otherwise); the run's
**trainers** are announced; one of them is **reachable** from here; a **weight** manifest of its newest
policy version can be fetched from its publisher; a **room** query (a push of no rollouts) is answered; and
**this machine** can be reached by others: directly, or through a relay reservation on a bootstrap when it is
behind a NAT (AutoNAT's verdict and the reservation, as the node's daemon reports its own addresses:
``net.reachability``). It prints one line per hop, stops at the first that fails with what is wrong and how
to fix it, and exits 1 then (0 when every hop passes, 2 on a bad address).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from echo_p2p import __version__
from echo_p2p.cli import EXIT_CONFIG, add_network_flags, fail, network_flags

#: Times the weights hop asks for the newest version's manifest when the publisher no longer has it.
MANIFEST_TRIES = 3
#: Seconds each network hop may take (a DHT read, a dial, an RPC).
HOP_TIMEOUT = 8.0
#: Most clock difference to the bootstrap that hivemind's DHT accepts (``MAX_DHT_TIME_DISCREPANCY_SECONDS``).
MAX_SKEW = 3.0
#: Seconds this machine is given to find out whether others can dial it (AutoNAT's dial-backs, then a relay
#: reservation on a bootstrap: seconds after start).
REACH_WAIT = 20.0


class HopFailed(Exception):
    """A hop that failed; the message says what is wrong and how to fix it."""


@dataclass
class Hop:
    name: str
    ok: bool
    detail: str


async def _clock_offset(_dht, node, peer_id: str) -> float:
    """Seconds the bootstrap's clock is ahead of this machine's (its DHT time in a ping's answer)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    request = dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False)
    sent = get_dht_time()
    answer = await node.protocol.get_stub(PeerID.from_base58(peer_id)).rpc_ping(request, timeout=HOP_TIMEOUT)
    return answer.dht_time - (sent + get_dht_time()) / 2


class Doctor:
    """The hops of one join address, checked in order (``run``); ``close`` stops what it started."""

    def __init__(self, join, network) -> None:
        from echo_p2p.net.keys import SwarmKeys

        self.join = join  # a run_record.JoinAddress
        self.network = network  # a NetworkConfig (initial peers: the address's)
        self.keys = SwarmKeys(join.run_id)
        self.identity = None
        self.dht = None
        self.directory = None
        self.endpoint = None  # a weights endpoint that serves nothing: dials and asks
        self.record = None  # the run record found
        self.trainers: list = []  # directory entries of the run's announced trainers
        self.reachable = None  # the first trainer entry that answered

    def hops(self) -> list[tuple[str, Callable[[], str]]]:
        return [
            ("bootstrap", self.bootstrap),
            ("clock", self.clock),
            ("run record", self.run_record),
            ("trainers", self.listed_trainers),
            ("trainer reachable", self.trainer_reachable),
            ("weights", self.weights),
            ("room", self.room),
            ("this machine", self.this_machine),
        ]

    def run(self, report: Callable[[Hop], None] = lambda hop: None) -> list[Hop]:
        done: list[Hop] = []
        for name, check in self.hops():
            try:
                hop = Hop(name, True, check())
            except HopFailed as exc:
                hop = Hop(name, False, str(exc))
            done.append(hop)
            report(hop)
            if not hop.ok:
                break
        return done

    # ---- the hops ---------------------------------------------------------------------------------------
    def bootstrap(self) -> str:
        from echo_p2p.net.directory import SwarmDirectory
        from echo_p2p.net.identity import load_or_create_identity
        from echo_p2p.net.node import NodeStartError, start_dht

        self.identity = load_or_create_identity(None)
        t0 = time.monotonic()
        try:
            self.dht = start_dht(self.network, self.identity, [self.keys])
        except NodeStartError as exc:
            raise HopFailed(str(exc)) from None
        self.directory = SwarmDirectory(self.dht, self.keys, self.identity, HOP_TIMEOUT)
        return f"{', '.join(self.network.initial_peers)} answered in {time.monotonic() - t0:.1f} s"

    def clock(self) -> str:
        peer_id = self.network.initial_peers[0].rsplit("/p2p/", 1)[-1]
        try:
            offset = self.dht.run_coroutine(partial(_clock_offset, peer_id=peer_id))
        except Exception as exc:
            raise HopFailed(f"the bootstrap did not answer a ping with its time ({exc!r})") from None
        if abs(offset) > MAX_SKEW:
            raise HopFailed(
                f"this machine's clock is {-offset:+.1f} s off the bootstrap's; DHT nodes must agree within "
                f"{MAX_SKEW:.0f} s: set the clock (e.g. timedatectl set-ntp true)"
            )
        return f"{-offset:+.2f} s off the bootstrap's"

    def run_record(self) -> str:
        from echo_p2p.guard.trust import RunTrust
        from echo_p2p.net.directory import find_run_record

        trust = RunTrust(owner=self.join.owner, run_id=self.join.run_id, min_serial=self.join.min_serial)
        missing = find_run_record(self.directory, trust)  # as long as a joining peer looks
        if missing is not None:
            raise HopFailed(missing)
        self.record = r = trust.record
        return (
            f"serial {r.serial} signed by {self.join.owner}: {len(r.trainers)} trainer(s), "
            f"model {r.model}, task {r.task}, mode {r.mode}"
        )

    def listed_trainers(self) -> str:
        wanted = set(self.record.trainers)
        self.trainers = [
            e for e in self.directory.trainers() if e.record.peer_id in wanted and e.record.state == "running"
        ]
        if not self.trainers:
            raise HopFailed(
                f"none of the run's {len(wanted)} trainer(s) is announced on the DHT: they are not running "
                "(the owner starts them: the trainer lines python -m echo_p2p.owner init printed)"
            )
        return f"{len(self.trainers)} of {len(wanted)} announced: " + ", ".join(
            e.record.peer_id for e in self.trainers
        )

    def trainer_reachable(self) -> str:
        from echo_p2p.transport.weights.service import WeightsEndpoint

        self.endpoint = WeightsEndpoint(self.dht, self.keys, serve=False).start(HOP_TIMEOUT)
        failures = []
        for entry in self.trainers:
            record = entry.record
            try:
                self.endpoint.run(
                    self.endpoint.connect(record.peer_id, record.maddrs, HOP_TIMEOUT), HOP_TIMEOUT + 1
                )
            except Exception as exc:
                failures.append(f"{record.peer_id} at {', '.join(record.maddrs) or 'no address'} ({exc!r})")
                continue
            self.reachable = entry
            return f"{record.peer_id} at {', '.join(record.maddrs)}"
        raise HopFailed(
            "no trainer answers from here: "
            + "; ".join(failures)
            + " (a trainer must be reachable: a public "
            "address or an open port, or a relayed address through the bootstrap)"
        )

    def weights(self) -> str:

        # a fast run replaces a version's manifests within seconds (a newer keyframe): a manifest gone by the
        # time it is asked for is asked again for the newest record, a few times
        for _ in range(MANIFEST_TRIES - 1):
            try:
                return self._weights_once()
            except HopFailed as exc:
                if "(none)" not in str(exc):
                    raise
                time.sleep(0.5)
        return self._weights_once()

    def _weights_once(self) -> str:
        from echo_p2p.proto import weights_pb2
        from echo_p2p.weights.manifest import Manifest

        trusted = set(self.record.trainers)
        policies = [e.record for e in self.directory.policies() if e.record.peer_id in trusted]
        if not policies:
            raise HopFailed(
                "no policy version is published by the run's trainers yet (a trainer publishes at start)"
            )
        policy = max(policies, key=lambda p: p.version)
        if not policy.manifests:
            raise HopFailed(f"the policy record of version {policy.version} lists no manifest")
        ref = policy.manifests[-1]
        request = weights_pb2.ManifestsRequest(digests=[bytes.fromhex(ref.digest)])
        try:
            self.endpoint.run(
                self.endpoint.connect(policy.peer_id, policy.maddrs, HOP_TIMEOUT), HOP_TIMEOUT + 1
            )
            answer = self.endpoint.run(
                self.endpoint.get_manifests(policy.peer_id, request, HOP_TIMEOUT), HOP_TIMEOUT + 1
            )
        except Exception as exc:
            raise HopFailed(f"the publisher {policy.peer_id} did not serve a manifest ({exc!r})") from None
        if answer.error or not answer.manifests:
            raise HopFailed(
                f"the publisher {policy.peer_id} did not serve its manifest ({answer.error or 'none'})"
            )
        manifest = Manifest.from_bytes(answer.manifests[0])
        return (
            f"version {manifest.version}: a manifest of {len(manifest.chunks)} chunk(s) from {policy.peer_id}"
        )

    def room(self) -> str:
        from echo_p2p.transport.p2p_loop import peer_id_of
        from echo_p2p.transport.rollouts.config import rollout_namespace
        from echo_p2p.transport.rollouts.push import push_payloads

        peer_id = self.reachable.record.peer_id
        namespace = rollout_namespace(self.keys)
        try:
            ack = self.endpoint.run(
                push_payloads(self.endpoint.p2p, peer_id_of(peer_id), namespace, []), HOP_TIMEOUT * 2
            )
        except Exception as exc:
            raise HopFailed(f"trainer {peer_id} did not answer a room query ({exc!r})") from None
        if ack.error:
            raise HopFailed(f"trainer {peer_id} refused a room query: {ack.error}")
        return (
            f"trainer {peer_id} has room for {ack.free_room} group(s), at policy version {ack.policy_version}"
        )

    def this_machine(self) -> str:
        from echo_p2p.net.reachability import Reachability

        reach = Reachability(self.dht, self.network.initial_peers, period=2.0)  # also its read deadline
        deadline = time.monotonic() + REACH_WAIT
        maddrs, status = reach.current()
        while status == "unreachable" and time.monotonic() < deadline:
            time.sleep(1.0)
            maddrs, status = reach.current()
        more = f" (+{len(maddrs) - 1} more)" if len(maddrs) > 1 else ""
        if status == "direct":
            return f"others in the run's scope can dial it directly: {maddrs[0]}{more}"
        if status == "relayed":
            return f"behind a NAT, reachable through a relay reservation: {maddrs[0]}{more}"
        raise HopFailed(
            f"nobody in the run's scope can dial this machine, and no relay slot was reserved within "
            f"{REACH_WAIT:.0f} s: a peer here still samples and trains over its own connections, but serves no "
            "weights to others; forward a TCP port (--host-maddrs, --announce-maddrs) or check that the "
            "bootstrap relays (docs/protocol.md, 'Reachability')"
        )

    def close(self) -> None:
        from echo_p2p.net.node import stop_dht

        if self.endpoint is not None:
            self.endpoint.shutdown()
        if self.dht is not None:
            stop_dht(self.dht)
        if self.identity is not None:
            self.identity.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Check each hop of joining the run at ADDRESS; exit 1 at the first that fails."""
    parser = argparse.ArgumentParser(prog="python -m echo_p2p.doctor", description=main.__doc__)
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    parser.add_argument("--join", required=True, metavar="RUN:OWNER@MADDRS", help="the run's join address")
    add_network_flags(parser, host_default_help="default /ip4/0.0.0.0/tcp/0")
    args = parser.parse_args(argv)
    from echo_p2p.config import ConfigError, build_config
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.run_record import JoinAddress

    try:
        join = JoinAddress.parse(args.join)
        flags = {k.removeprefix("network."): v for k, v in network_flags(args).items()}
        flags["initial_peers"] = flags["initial_peers"] or list(join.initial_peers)
        network = build_config(NetworkConfig, environ={}, flags=flags)
    except (ConfigError, ValueError) as exc:
        fail(str(exc), EXIT_CONFIG)
    from echo_p2p.logs import setup_logging

    setup_logging("ERROR")
    doctor = Doctor(join, network)

    def report(hop: Hop) -> None:
        print(f"{'ok  ' if hop.ok else 'FAIL'} {hop.name}: {hop.detail}", flush=True)

    try:
        hops = doctor.run(report)
    finally:
        doctor.close()
    sys.exit(0 if all(h.ok for h in hops) else 1)


if __name__ == "__main__":
    main()
