"""``python -m echo_p2p.peer --role inference|trainer --initial-peers MADDR... --run-id NAME``

Parses flags, merges them over the YAML config (``--config``) and ``ECHO_*`` variables, validates
everything (exit 2 on a bad field) and only then imports the heavy stack and starts the role's peer.
"""

from __future__ import annotations

import argparse
import os
import sys

from echo_p2p import __version__
from echo_p2p.cli import (
    EXIT_CONFIG,
    EXIT_START,
    add_network_flags,
    fail,
    install_stop_handlers,
    network_flags,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.peer",
        description="Join an echo_p2p run as an inference or trainer peer. "
        "Precedence: flags > ECHO_* environment variables > --config YAML > defaults.",
    )
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    parser.add_argument(
        "--role", choices=["inference", "trainer"], default=None, help="the peer's role (env ECHO_ROLE)"
    )
    parser.add_argument("--run-id", default=None, help="name of the run to join (env ECHO_RUN_ID)")
    parser.add_argument("--config", metavar="FILE", default=None, help="YAML config file (see peers/*.yaml)")
    parser.add_argument(
        "--mode", choices=["sync", "async"], default=None, help="sync: sequential pull; async: push-pull"
    )
    parser.add_argument(
        "--metrics-dir", metavar="DIR", default=None, help="append metrics as JSON lines here"
    )
    parser.add_argument(
        "--heartbeat-period", type=float, metavar="S", default=None, help="seconds between announcements"
    )
    parser.add_argument(
        "--record-ttl", type=float, metavar="S", default=None, help="lifetime of an announcement"
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default=None)
    add_network_flags(parser, host_default_help="default /ip4/0.0.0.0/tcp/0: all interfaces, a free port")
    return parser


def parse_config(argv: list[str] | None = None, environ=None):
    """Flags + env + YAML -> ``PeerConfig``; raises ``ConfigError``."""
    from echo_p2p.config import PeerConfig, build_config

    args = build_parser().parse_args(argv)
    flags = {
        "role": args.role,
        "run_id": args.run_id,
        "mode": args.mode,
        "metrics_dir": args.metrics_dir,
        "heartbeat_period": args.heartbeat_period,
        "record_ttl": args.record_ttl,
        "log_level": args.log_level,
        **network_flags(args),
    }
    return build_config(
        PeerConfig, yaml_path=args.config, environ=os.environ if environ is None else environ, flags=flags
    )


def make_peer(config):
    if config.role == "inference":
        from echo_p2p.roles.inference import InferencePeer

        return InferencePeer(config)
    from echo_p2p.roles.trainer import TrainerPeer

    return TrainerPeer(config)


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError

    try:
        config = parse_config(argv)
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    from echo_p2p.logs import setup_logging

    setup_logging(config.log_level)
    from echo_p2p.net.identity import IdentityError
    from echo_p2p.net.node import NodeStartError

    try:
        peer = make_peer(config)
    except IdentityError as exc:
        fail(str(exc), EXIT_START)
    install_stop_handlers(peer.request_stop)
    try:
        peer.start()
        peer.run()
    except NodeStartError as exc:
        peer.shutdown()
        fail(str(exc), EXIT_START)
    except KeyboardInterrupt:
        pass
    finally:
        peer.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
