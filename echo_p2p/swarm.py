"""``python -m echo_p2p.swarm status --initial-peers ... --run-id NAME [--json]``: who is in a run.

Joins the DHT as a client (it stores nothing and serves nothing), reads the run's peer records and prints
them as a table for people or as JSON for programs: peer id, role, state, policy version held, rates and
how long ago each peer last announced itself.
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
    add_network_flags(status, host_default_help="default /ip4/0.0.0.0/tcp/0")
    return parser


def peer_rows(entries, now: float) -> list[dict[str, Any]]:
    rows = []
    for entry in entries:
        r = entry.record
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
        lines.append(
            f"{'…' + r['peer_id'][-19:]:<20} {r['role']:<10} {r['state']:<8} {fmt(r['mode']):<5} "
            f"{fmt(r['policy_version']):>5} {fmt(r['tokens_per_second'], '.1f'):>8} "
            f"{fmt(r['rollouts_per_second'], '.2f'):>7} {fmt(r['free_buffer_room']):>5} {r['last_seen_s']:>5.0f}s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError, NetworkConfig, build_config
    from echo_p2p.net.keys import validate_run_id

    args = build_parser().parse_args(argv)
    run_id = args.run_id or os.environ.get("ECHO_RUN_ID")
    try:
        if not run_id:
            raise ConfigError("config field 'run_id': required (pass --run-id or set ECHO_RUN_ID)")
        validate_run_id(run_id)
        flags = {k.removeprefix("network."): v for k, v in network_flags(args).items()}
        env = {k: v for k, v in os.environ.items() if k in ("ECHO_INITIAL_PEERS", "ECHO_HOST_MADDRS")}
        fields = {"ECHO_INITIAL_PEERS": "initial_peers", "ECHO_HOST_MADDRS": "host_maddrs"}
        network = build_config(NetworkConfig, environ=env, env_fields=fields, flags=flags)
        if not network.initial_peers:
            raise ConfigError("config field 'initial_peers': required to find the run (pass --initial-peers)")
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
        rows = peer_rows(directory.peers(), time.time())
        if args.json:
            out = {"run_id": run_id, "time": time.time(), "peers": rows, "rejected": dict(directory.rejected)}
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


if __name__ == "__main__":
    main()
