"""``python -m echo_p2p.monitor --join RUN:OWNER@MADDRS`` (or ``--run-id NAME --initial-peers MADDR...``):
serve a live page of one run.

Parses the flags (exit 2 on a bad one, before any network start), joins the DHT as a client (it stores
nothing, serves nothing on the DHT), reads the run's directory every ``--poll-period`` seconds and serves
the page on ``--host:--port`` (127.0.0.1:8470 by default: this machine only) until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import threading

from echo_p2p import __version__
from echo_p2p.cli import EXIT_CONFIG, EXIT_START, fail, install_stop_handlers
from echo_p2p.monitor.config import DEFAULT_PORT
from echo_p2p.monitor.target import add_target_flags, resolve_target


def add_server_flags(parser: argparse.ArgumentParser, port_default: int = DEFAULT_PORT) -> None:
    group = parser.add_argument_group("monitor page")
    group.add_argument(
        "--host",
        default=None,
        help="address to listen on (default 127.0.0.1: reachable from this machine only)",
    )
    group.add_argument(
        "--port",
        type=int,
        default=None,
        help=f"TCP port of the page (default {port_default}; 0: any free port)",
    )
    group.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a host name the page may be reached by besides localhost and IP addresses (e.g. behind a "
        "reverse proxy); repeatable",
    )
    group.add_argument(
        "--poll-period", type=float, default=None, metavar="S", help="seconds between DHT reads"
    )
    group.add_argument(
        "--stall-after", type=float, default=None, metavar="S", help="alert when no new version for S seconds"
    )
    group.add_argument(
        "--buffer-empty-after",
        type=float,
        default=None,
        metavar="S",
        help="alert when a trainer's buffer stays empty for S seconds",
    )


def monitor_config(args: argparse.Namespace):
    """``MonitorConfig`` from the flags of ``add_server_flags``; raises ``ConfigError``."""
    from pydantic import ValidationError

    from echo_p2p.config import ConfigError, format_validation_error
    from echo_p2p.monitor.config import MonitorConfig

    fields = {
        "host": args.host,
        "port": args.port,
        "allowed_hosts": args.allow_host,
        "poll_period": args.poll_period,
        "stall_after": args.stall_after,
        "buffer_empty_after": args.buffer_empty_after,
    }
    try:
        return MonitorConfig(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.monitor",
        description="Serve a live page of an echo_p2p run (read from the DHT; it changes nothing).",
    )
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    add_target_flags(parser)
    add_server_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        target = resolve_target(args)
        config = monitor_config(args)
    except (ConfigError, ValueError) as exc:
        fail(str(exc), EXIT_CONFIG)

    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    from echo_p2p.net.lean_hivemind import use_lean_hivemind

    use_lean_hivemind()  # before any hivemind import: the monitor reads records, it never needs torch
    from echo_p2p.monitor.poller import Poller
    from echo_p2p.monitor.server import MonitorServer
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.node import NodeStartError, neighbour_counts, start_dht, stop_dht

    stop = threading.Event()
    install_stop_handlers(stop.set)
    identity = load_or_create_identity(target.network.identity_path)
    dht = poller = server = None
    code = 0
    try:
        keys = SwarmKeys(target.run_id)
        dht = start_dht(target.network, identity, [keys], client_mode=True, in_process=True)
        directory = SwarmDirectory(dht, keys, identity, target.network.request_timeout)
        poller = Poller(directory, target.run_id, target.trust, config, lambda: neighbour_counts(dht)[1])
        poller.start()
        server = MonitorServer(poller, config)
        url = server.start()
        print(f"monitor of run {target.run_id}: {url}", flush=True)
        stop.wait()
    except NodeStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_START
    except OSError as exc:
        print(
            f"error: cannot serve the monitor on {config.host}:{config.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        code = EXIT_START
    finally:
        if server is not None:
            server.stop()
        if poller is not None:
            poller.stop()
        if dht is not None:
            stop_dht(dht)
        identity.cleanup()
    sys.exit(code)


if __name__ == "__main__":
    main()
