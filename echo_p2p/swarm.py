"""``python -m echo_p2p.swarm status --initial-peers ... --run-id NAME [--json]``: who is in a run.

Joins the DHT as a client (it stores nothing and serves nothing), reads the run's directory once and prints
it as a table for people (REACH: direct, relayed or unreachable, from the addresses each peer announces),
or as JSON for programs — the status that the monitor serves at ``/api/status``
(``echo_p2p.monitor.status``: run header, peers, publishers, bans, alerts). Given the run's join address
(or its trusted-trainers file), peers that announce themselves trainers without being the run's are marked
IMPOSTOR.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from echo_p2p import __version__
from echo_p2p.cli import EXIT_CONFIG, EXIT_START, fail
from echo_p2p.monitor.target import add_target_flags, resolve_target


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m echo_p2p.swarm", description="Inspect an echo_p2p run.")
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="list the peers of a run")
    status.add_argument(
        "--json", action="store_true", help="print JSON (what the monitor serves at /api/status)"
    )
    add_target_flags(status)
    return parser


def format_table(run_id: str, rows: list[dict[str, Any]], directory: dict[str, Any] | None = None) -> str:
    """The peers as a table; with ``directory`` (a status's ``directory``), a last line saying how many
    inference peers the read did not see (the directory buckets not read: an estimate)."""

    def fmt(v: Any, spec: str = "") -> str:
        return "-" if v is None else format(v, spec)

    header = (
        f"{'PEER ID':<20} {'ROLE':<10} {'STATE':<8} {'MODE':<5} {'REACH':<11} {'VER':>5} {'TOK/S':>8} "
        f"{'ROLL/S':>7} {'ROOM':>5} {'WAIT':>5} {'SEEN':>6}"
    )
    lines = [f"run {run_id}: {len(rows)} peer(s)", header]
    for r in rows:
        state = "IMPOSTOR" if r.get("trusted") is False else "STALLED" if r.get("stalled") else r["state"]
        lines.append(
            f"{'…' + r['peer_id'][-19:]:<20} {r['role']:<10} {state:<8} {fmt(r['mode']):<5} "
            f"{fmt(r.get('reachability')):<11} "
            f"{fmt(r['policy_version']):>5} {fmt(r['tokens_per_second'], '.1f'):>8} "
            f"{fmt(r['rollouts_per_second'], '.2f'):>7} {fmt(r['free_buffer_room']):>5} {_share(r.get('waiting_for_grants')):>5} "
            f"{fmt(r['last_seen_s'], '.0f'):>5}s"
        )
    if directory and directory.get("total"):
        lines.append(
            f"not seen: ~{directory.get('unseen_peers') or 0} peer(s) "
            f"({directory.get('known')} of {directory['total']} directory bucket(s) read)"
        )
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def format_alerts(status: dict[str, Any]) -> str:
    return "\n".join(f"ALERT {a['code']}: {a['message']}" for a in status.get("alerts", []))


class StatusReader:
    """Reads the status of runs (what ``status`` prints) through one client-mode DHT node, kept for every
    read: ``status`` starts one per command, a program that polls keeps one. ``targets``: run id -> the
    ``monitor.target.Target`` to read (they share their network settings); raises ``NodeStartError``."""

    def __init__(self, targets: dict[str, Any]):
        from echo_p2p.net.lean_hivemind import use_lean_hivemind

        use_lean_hivemind()  # before any hivemind import: reading a run's status needs no torch
        from echo_p2p.monitor.sampling import BucketSampler
        from echo_p2p.net.identity import load_or_create_identity
        from echo_p2p.net.keys import SwarmKeys
        from echo_p2p.net.node import start_dht

        self.targets = targets
        network = next(iter(targets.values())).network
        self.identity = load_or_create_identity(network.identity_path)
        self.keys = {run_id: SwarmKeys(run_id) for run_id in targets}
        self.samplers = {run_id: BucketSampler() for run_id in targets}  # a poller sees every bucket in turn
        try:
            self.dht = start_dht(
                network, self.identity, list(self.keys.values()), client_mode=True, in_process=True
            )
        except BaseException:
            self.identity.cleanup()
            raise

    def status(self, run_id: str) -> dict[str, Any]:
        from echo_p2p.monitor.status import build_status, read_snapshot
        from echo_p2p.net.directory import SwarmDirectory
        from echo_p2p.net.node import neighbour_counts

        target = self.targets[run_id]
        directory = SwarmDirectory(self.dht, self.keys[run_id], self.identity, target.network.request_timeout)
        snapshot = read_snapshot(
            directory, run_id, target.trust, lambda: neighbour_counts(self.dht)[1], self.samplers[run_id]
        )
        return build_status(snapshot)

    def close(self) -> None:
        from echo_p2p.net.node import stop_dht

        stop_dht(self.dht)
        self.identity.cleanup()


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        target = resolve_target(args)
    except (ConfigError, ValueError) as exc:
        fail(str(exc), EXIT_CONFIG)

    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    from echo_p2p.net.node import NodeStartError

    try:
        reader = StatusReader({target.run_id: target})
    except NodeStartError as exc:
        fail(str(exc), EXIT_START)
    try:
        status = reader.status(target.run_id)
        if args.json:
            print(json.dumps(status, indent=2, allow_nan=False))
        else:
            print(format_table(target.run_id, status["peers"], status["directory"]))
            if status["alerts"]:
                print(format_alerts(status))
    finally:
        reader.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
