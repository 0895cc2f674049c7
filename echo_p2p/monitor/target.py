"""Which run a reader looks at: the flags ``--run-id``/``--join``/``--trusted-trainers`` (and the network
flags) shared by ``swarm status`` and the monitor CLI, turned into a ``Target``.

Owned here: ``add_target_flags`` and ``resolve_target``. A join address gives the run id, the bootstrap
addresses and the owner whose signed run record says who the trainers are; ``--trusted-trainers FILE`` does
the latter for runs without an owner; with neither, the reader has no opinion on who is a trainer.
Validation only: no network I/O; raises ``ConfigError``/``ValueError`` with a message for the user.
Cheap to import (``--help`` stays instant).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from echo_p2p.cli import add_network_flags, network_flags


@dataclass
class Target:
    run_id: str
    network: Any  # net.network_config.NetworkConfig
    trust: Any  # guard.trust.RunTrust


def add_target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-id", default=None, help="the run (env ECHO_RUN_ID)")
    parser.add_argument(
        "--join",
        metavar="RUN:OWNER@MADDRS",
        default=None,
        help="the run's join address: trainers not in the owner's run record are marked IMPOSTOR",
    )
    parser.add_argument(
        "--trusted-trainers",
        metavar="FILE",
        default=None,
        help="for runs without an owner: trainers not in this file are marked IMPOSTOR",
    )
    add_network_flags(parser, host_default_help="default /ip4/0.0.0.0/tcp/0")


def resolve_target(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Target:
    """The run, the network settings of a client-mode reader and its ``RunTrust``, from parsed flags."""
    from echo_p2p.config import ConfigError, build_config
    from echo_p2p.net.keys import validate_run_id
    from echo_p2p.net.network_config import NetworkConfig

    environ = os.environ if environ is None else environ
    run_id = args.run_id or environ.get("ECHO_RUN_ID")
    join = None
    if args.join is not None:
        from echo_p2p.net.run_record import JoinAddress

        join = JoinAddress.parse(args.join)
        if args.run_id is not None and args.run_id != join.run_id:
            raise ConfigError(f"--run-id {args.run_id} differs from the run of --join ({join.run_id})")
        run_id = join.run_id
        if not args.initial_peers:
            args.initial_peers = list(join.initial_peers)
    if not run_id:
        raise ConfigError("config field 'run_id': required (pass --run-id, --join or set ECHO_RUN_ID)")
    validate_run_id(run_id)
    flags = {k.removeprefix("network."): v for k, v in network_flags(args).items()}
    env = {k: v for k, v in environ.items() if k in ("ECHO_INITIAL_PEERS", "ECHO_HOST_MADDRS")}
    fields = {"ECHO_INITIAL_PEERS": "initial_peers", "ECHO_HOST_MADDRS": "host_maddrs"}
    network = build_config(NetworkConfig, environ=env, env_fields=fields, flags=flags)
    if not network.initial_peers:
        raise ConfigError("config field 'initial_peers': required to find the run (pass --initial-peers)")
    return Target(run_id, network, _trust(join, args.trusted_trainers, run_id))


def _trust(join, trusted_trainers: str | None, run_id: str):
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers

    if join is not None and trusted_trainers:
        raise ValueError(
            "give either --join or --trusted-trainers, not both: the run record lists the trainers"
        )
    if join is not None:
        return RunTrust(owner=join.owner, run_id=run_id)
    if trusted_trainers:
        return RunTrust(fixed=TrustedTrainers.from_file(trusted_trainers))
    return RunTrust()
