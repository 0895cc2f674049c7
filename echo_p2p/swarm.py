"""``python -m echo_p2p.swarm status --initial-peers ... --run-id NAME [--json]``: who is in a run.

Joins the DHT as a client (it stores nothing and serves nothing), reads the run's peer records and prints
them as a table for people or as JSON for programs: peer id, role, state, policy version held, rates and
how long ago each peer last announced itself. Given the run's join address (or its trusted-trainers file),
peers that announce themselves trainers without being the run's are marked IMPOSTOR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from echo_p2p import __version__
from echo_p2p.cli import EXIT_CONFIG, EXIT_START, add_network_flags, fail, network_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m echo_p2p.swarm", description="Inspect an echo_p2p run.")
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="list the peers of a run")
    status.add_argument("--run-id", default=None, help="the run (env ECHO_RUN_ID)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument(
        "--join",
        metavar="RUN:OWNER@MADDRS",
        default=None,
        help="the run's join address: trainers not in the owner's run record are marked IMPOSTOR",
    )
    status.add_argument(
        "--trusted-trainers",
        metavar="FILE",
        default=None,
        help="for runs without an owner: trainers not in this file are marked IMPOSTOR",
    )
    add_network_flags(status, host_default_help="default /ip4/0.0.0.0/tcp/0")
    return parser


def peer_rows(entries, now: float, trust=None) -> list[dict[str, Any]]:
    """One row per peer; with ``trust`` (a ``RunTrust``), trainers get ``trusted`` True/False."""
    rows = []
    for entry in entries:
        r = entry.record
        trusted = None
        if trust is not None and trust.configured and r.role == "trainer":
            trusted = trust.is_trusted(r.peer_id)
        rows.append(
            {
                "peer_id": r.peer_id,
                "role": r.role,
                "state": r.state,
                "mode": r.mode,
                "policy_version": r.policy_version,
                "software_version": r.software_version,
                "tokens_per_second": r.tokens_per_second,
                "rollouts_per_second": r.rollouts_per_second,
                "free_buffer_room": r.free_buffer_room,
                "last_seen_s": round(max(0.0, now - r.updated_at), 1),
                "uptime_s": round(max(0.0, now - r.started_at), 1),
                "expires_in_s": round(entry.expires_at - now, 1),
                "maddrs": r.maddrs,
                "trusted": trusted,
            }
        )
    rows.sort(key=lambda row: (row["role"], row["peer_id"]))
    return rows


def format_table(run_id: str, rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    header = f"{'PEER ID':<20} {'ROLE':<10} {'STATE':<8} {'MODE':<5} {'VER':>5} {'TOK/S':>8} {'ROLL/S':>7} {'ROOM':>5} {'SEEN':>6}"
    lines = [f"run {run_id}: {len(rows)} peer(s)", header]
    for r in rows:
        state = "IMPOSTOR" if r.get("trusted") is False else r["state"]
        lines.append(
            f"{'…' + r['peer_id'][-19:]:<20} {r['role']:<10} {state:<8} {fmt(r['mode']):<5} "
            f"{fmt(r['policy_version']):>5} {fmt(r['tokens_per_second'], '.1f'):>8} "
            f"{fmt(r['rollouts_per_second'], '.2f'):>7} {fmt(r['free_buffer_room']):>5} {r['last_seen_s']:>5.0f}s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError, NetworkConfig, build_config
    from echo_p2p.net.keys import validate_run_id

    args = build_parser().parse_args(argv)
    run_id = args.run_id or os.environ.get("ECHO_RUN_ID")
    join = None
    try:
        if args.join is not None:
            from echo_p2p.net.run_record import JoinAddress

            join = JoinAddress.parse(args.join)
            run_id = join.run_id
            if not args.initial_peers:
                args.initial_peers = list(join.initial_peers)
        if not run_id:
            raise ConfigError("config field 'run_id': required (pass --run-id or set ECHO_RUN_ID)")
        validate_run_id(run_id)
        flags = {k.removeprefix("network."): v for k, v in network_flags(args).items()}
        env = {k: v for k, v in os.environ.items() if k in ("ECHO_INITIAL_PEERS", "ECHO_HOST_MADDRS")}
        fields = {"ECHO_INITIAL_PEERS": "initial_peers", "ECHO_HOST_MADDRS": "host_maddrs"}
        network = build_config(NetworkConfig, environ=env, env_fields=fields, flags=flags)
        if not network.initial_peers:
            raise ConfigError("config field 'initial_peers': required to find the run (pass --initial-peers)")
        trust = _trust(join, args.trusted_trainers, run_id)
    except (ConfigError, ValueError) as exc:
        fail(str(exc), EXIT_CONFIG)

    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.node import NodeStartError, start_dht, stop_dht

    keys = SwarmKeys(run_id)
    identity = load_or_create_identity(network.identity_path)
    dht = None
    try:
        dht = start_dht(network, identity, [keys], client_mode=True)
        directory = SwarmDirectory(dht, keys, identity, network.request_timeout)
        if trust.owner is not None:
            trust.update(entry.record for entry in directory.run_records())
        rows = peer_rows(directory.peers(), time.time(), trust)
        if args.json:
            out = {
                "run_id": run_id,
                "time": time.time(),
                "trust": trust.describe(),
                "peers": rows,
                "rejected": dict(directory.rejected),
            }
            print(json.dumps(out, indent=2))
        else:
            print(format_table(run_id, rows))
    except NodeStartError as exc:
        fail(str(exc), EXIT_START)
    finally:
        if dht is not None:
            stop_dht(dht)
        identity.cleanup()
    sys.exit(0)


def _trust(join, trusted_trainers: str | None, run_id: str):
    from echo_p2p.transport.trust import RunTrust, TrustedTrainers

    if join is not None:
        return RunTrust(owner=join.owner, run_id=run_id)
    if trusted_trainers:
        return RunTrust(fixed=TrustedTrainers.from_file(trusted_trainers))
    return RunTrust()


if __name__ == "__main__":
    main()
