"""``python -m echo_p2p.bootstrap``: a long-lived DHT node that newcomers dial first.

Owned here: the bootstrap peer (``BootstrapPeer``) and its CLI. It stores and serves DHT records for any
run (signature-checked; schema-checked for the runs named with ``--run-id``), prints its multiaddrs ready
to paste after ``--initial-peers``, writes them to ``--maddrs-file``, logs how many peers it sees, with
``--monitor-port`` serves the live monitor page of its run (``echo_p2p.monitor``, read-only, from its own
DHT node), and stops cleanly on SIGINT/SIGTERM with no p2pd or child process left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from echo_p2p import __version__
from echo_p2p.cli import (
    EXIT_CONFIG,
    EXIT_START,
    add_network_flags,
    fail,
    network_flags,
    run_peer,
)

logger = logging.getLogger("echo_p2p.bootstrap")

#: Seconds between two stores of the run record a bootstrap keeps (it lives three periods).
RUN_RECORD_PERIOD = 20.0


class BootstrapPeer:
    """A DHT node with echo_p2p's validators; ``run()`` loops on a status period until ``request_stop``."""

    def __init__(self, config, monitor=None):
        from echo_p2p.net.lean_hivemind import use_lean_hivemind

        use_lean_hivemind()  # first: a bootstrap never imports torch (the DHT node runs in this process)
        from echo_p2p.net.identity import load_or_create_identity

        self.config = config
        self.monitor_config = monitor  # a monitor.config.MonitorConfig: serve the run's monitor page
        self._monitor: tuple = ()  # (server, poller) while it serves
        self.identity = load_or_create_identity(config.network.identity_path)
        self.stop_event = threading.Event()
        self.dht = None
        self.maddrs: list[str] = []
        self._stopped = False
        self._run_record = None  # (SwarmKeys, SignedRunRecord, RunRecord) this bootstrap keeps on the DHT
        # (SwarmDirectory, RunTrust) of that run: whom this node takes trainer records and run records from
        self._run_trust = None

    def start(self) -> None:
        from echo_p2p.net.keys import SwarmKeys
        from echo_p2p.net.node import start_dht, visible_maddrs

        t0 = time.monotonic()
        run_ids = list(self.config.run_ids)
        if self.config.run_record:
            from echo_p2p.net.records import SignedRunRecord
            from echo_p2p.net.run_record import read_file

            record, record_bytes, signature = read_file(self.config.run_record)  # ValueError: a start error
            self._run_record = (
                SwarmKeys(record.run_id),
                SignedRunRecord(peer_id=self.identity.peer_id, record=record_bytes, signature=signature),
                record,
            )
            run_ids.append(record.run_id)
        keys = [SwarmKeys(run_id) for run_id in dict.fromkeys(run_ids)]
        self.dht = start_dht(self.config.network, self.identity, keys, in_process=True)
        self._keep_run_record()
        self.maddrs = visible_maddrs(self.dht)
        if self.config.maddrs_file:
            tmp = self.config.maddrs_file + ".tmp"
            with open(tmp, "w") as f:
                f.write("".join(m + "\n" for m in self.maddrs))
            os.replace(tmp, self.config.maddrs_file)
        if self.identity.ephemeral:
            logger.warning("no --identity-path: this bootstrap's peer id will change when it restarts")
        logger.info("bootstrap %s ready in %.2f s", self.identity.peer_id, time.monotonic() - t0)
        print("Peers join this swarm with:\n  --initial-peers " + " ".join(self.maddrs), flush=True)
        from echo_p2p.net.run_record import JoinAddress

        if self._run_record is not None:
            record = self._run_record[2]
            join = JoinAddress(record.run_id, record.owner_peer_id(), tuple(self.maddrs), record.serial)
            print(f"and the run {record.run_id} with:\n  --join {join}", flush=True)
        else:  # no record kept here: the address of any run whose trainers keep theirs, owner left to fill
            join = JoinAddress("RUN_ID", "OWNER_PEER_ID", tuple(self.maddrs))
            print(
                f"and a run with (its owner's peer id: python -m echo_p2p.owner show RECORD):\n  --join {join}"
            )
        if self.monitor_config is not None:
            self._start_monitor(self._run_record[0].run_id if self._run_record is not None else run_ids[0])

    def _start_monitor(self, run_id: str) -> None:
        """Serve the monitor page of ``run_id`` from this node (trust: the run record it keeps, if any)."""
        from echo_p2p.guard.trust import RunTrust
        from echo_p2p.monitor.embedded import serve_embedded

        record = self._run_record[2] if self._run_record is not None else None
        trust = RunTrust(owner=record.owner_peer_id(), run_id=run_id) if record is not None else RunTrust()
        try:  # no connection count: a bootstrap's node holds the records itself, alone or not
            server, poller, url = serve_embedded(self.dht, self.identity, run_id, trust, self.monitor_config)
        except OSError as exc:  # a busy port: a start error (run_peer prints it, exit 1)
            config = self.monitor_config
            raise ValueError(
                f"cannot serve the monitor on {config.host}:{config.port}: {exc.strerror}"
            ) from None
        self._monitor = (server, poller)
        print(f"monitor of run {run_id}: {url}", flush=True)

    def run(self) -> None:
        from echo_p2p.net.node import neighbour_counts

        if self.dht is None:
            self.start()
        next_status = time.monotonic() + self.config.status_period
        while not self.stop_event.wait(min(self.config.status_period, RUN_RECORD_PERIOD)):
            self._keep_run_record()
            if time.monotonic() < next_status:
                continue
            next_status = time.monotonic() + self.config.status_period
            try:
                table, connected = neighbour_counts(self.dht)
                logger.info(
                    "bootstrap %s sees %d DHT peers, %d connections",
                    self.identity.peer_id[-8:],
                    table,
                    connected,
                )
            except Exception as exc:
                logger.warning("could not count peers: %s", exc)

    def _keep_run_record(self) -> None:
        """Re-store the run record, follow the newest one the owner signed (the run's trainers may change) and
        tell this node whose trainer records to store (``SwarmDirectory.follow_trust``)."""
        if self._run_record is None:
            return
        from echo_p2p.guard.trust import RunTrust
        from echo_p2p.net.directory import SwarmDirectory

        keys, signed, record = self._run_record
        if self._run_trust is None:
            trust = RunTrust(owner=record.owner_peer_id(), run_id=record.run_id)
            trust.update([signed])
            self._run_trust = (SwarmDirectory(self.dht, keys, self.identity), trust)
        directory, trust = self._run_trust
        try:
            directory.follow_trust(trust)  # first: the trainers' records must not land before it knows them
            if not directory.announce_run_record(signed, 3 * RUN_RECORD_PERIOD):
                logger.warning("the run record of %s was not stored by any DHT node", keys.run_id)
            trust.update(e.record for e in directory.run_records())
            directory.follow_trust(trust)
        except Exception as exc:  # keep serving the DHT whatever happens
            logger.warning("storing the run record failed: %r", exc)

    def request_stop(self) -> None:
        self.stop_event.set()

    def shutdown(self) -> None:
        from echo_p2p.net.node import stop_dht

        if self._stopped:
            return
        self._stopped = True
        self.stop_event.set()
        for part in self._monitor:
            part.stop()
        if self.dht is not None:
            stop_dht(self.dht)
            self.dht = None
        self.identity.cleanup()
        logger.info("bootstrap stopped")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.bootstrap",
        description="Run a bootstrap peer: the door into echo_p2p runs. See bootstrap/README.md to deploy one.",
    )
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    parser.add_argument(
        "--config", metavar="FILE", default=None, help="YAML config (see bootstrap/bootstrap.yaml)"
    )
    parser.add_argument(
        "--maddrs-file", metavar="PATH", default=None, help="write the visible multiaddrs here once ready"
    )
    parser.add_argument(
        "--run-id",
        dest="run_ids",
        action="append",
        default=None,
        metavar="NAME",
        help="also schema-validate the records of this run (repeatable)",
    )
    parser.add_argument(
        "--run-record",
        metavar="FILE",
        default=None,
        help="keep this signed run record (python -m echo_p2p.owner sign) on the DHT: the door to the run",
    )
    parser.add_argument(
        "--status-period", type=float, metavar="S", default=None, help="seconds between status lines"
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default=None)
    parser.add_argument(
        "--monitor-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the live monitor page of the run (of --run-record, else the first --run-id) on this port "
        "(0: a free one)",
    )
    parser.add_argument(
        "--monitor-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address of the monitor page (default 127.0.0.1: this machine only)",
    )
    add_network_flags(
        parser, host_default_help="default /ip4/0.0.0.0/tcp/31337: all interfaces, the public default port"
    )
    return parser


def parse_config(argv: list[str] | None = None, environ=None):
    return parse_args(argv, environ)[0]


def parse_args(argv: list[str] | None = None, environ=None):
    """``(BootstrapConfig, MonitorConfig or None)`` from flags, environment and YAML; ``ConfigError``."""
    from echo_p2p.config import BOOTSTRAP_ENV_VARS, BootstrapConfig, ConfigError, build_config

    args = build_parser().parse_args(argv)
    flags = {
        "maddrs_file": args.maddrs_file,
        "run_record": args.run_record,
        "run_ids": args.run_ids,
        "status_period": args.status_period,
        "log_level": args.log_level,
        **network_flags(args),
    }
    config = build_config(
        BootstrapConfig,
        yaml_path=args.config,
        environ=os.environ if environ is None else environ,
        env_fields=BOOTSTRAP_ENV_VARS,
        flags=flags,
    )
    if args.monitor_port is None:
        return config, None
    if not config.run_record and not config.run_ids:
        raise ConfigError("--monitor-port needs the run to watch: --run-record FILE or --run-id NAME")
    from pydantic import ValidationError

    from echo_p2p.config import format_validation_error
    from echo_p2p.monitor.config import MonitorConfig

    try:
        return config, MonitorConfig(host=args.monitor_host, port=args.monitor_port)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError

    try:
        config, monitor = parse_args(argv)
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    from echo_p2p.logs import setup_logging

    setup_logging(config.log_level)
    from echo_p2p.net.identity import IdentityError

    try:
        peer = BootstrapPeer(config, monitor)
    except IdentityError as exc:
        fail(str(exc), EXIT_START)
    run_peer(peer, "bootstrap")


if __name__ == "__main__":
    main()
