"""``python -m echo_p2p.owner init|sign|show``: the run owner's tool, to start a run and sign its record
(docs/trust.md).

``init`` is the owner's one command: it makes the owner key, the trainers' and the bootstrap's identity
keys in one folder, signs the run record, and prints the run's join address and the exact lines that start
the bootstrap, each trainer and a donor's inference peer (``init_run``, ``start_lines``). ``sign`` writes a
signed ``RunRecord`` (the run's trainers, what it trains, a serial and an expiry) with the owner's identity
and prints the join address fragment; the bootstrap and the trainers are started with
``--run-record FILE`` and keep it on the DHT, every other peer joins with ``--join RUN:OWNER@MADDRS``.
``show`` verifies a record file and prints it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from echo_p2p.net.buckets import buckets_for
from echo_p2p.net.keys import validate_run_id
from echo_p2p.net.run_record import JoinAddress, RunRecord, read_file, sign, write_file

#: The port a public bootstrap listens on unless ``--port`` says otherwise.
DEFAULT_PORT = 31337


@dataclass(frozen=True)
class InitializedRun:
    """What ``init_run`` made: the folder's files and the run's join address."""

    run_id: str
    workdir: Path
    owner: str  # the owner key's peer id
    record: Path
    bootstrap_identity: Path
    bootstrap_listen: str  # the multiaddr the bootstrap listens on
    announce: str | None  # the multiaddr it tells others (a public address), None on 127.0.0.1
    trainer_identities: tuple[Path, ...]
    join_address: str
    model: str
    task: str
    mode: str
    expires_at: float


def init_run(
    run_id: str,
    workdir: Path,
    trainers: int = 1,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    model: str = "tiny",
    task: str = "count",
    mode: str = "async",
    valid_days: float = 30.0,
) -> InitializedRun:
    """Make (or keep) the owner's, the trainers' and the bootstrap's keys under ``workdir``, sign a new run
    record (a higher serial each time) and write the join address to ``workdir/join-address``."""
    import ipaddress

    from echo_p2p.local_keys import bootstrap_address, make_run_record

    validate_run_id(run_id)
    if not 1 <= trainers <= 64:
        raise ValueError(f"--trainers must be 1..64, got {trainers}")
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"--host must be an IPv4 address peers can dial, got {host!r}") from None
    workdir.mkdir(parents=True, exist_ok=True)
    record, owner = make_run_record(
        workdir,
        run_id,
        trainers,
        model,
        task,
        mode,
        note="python -m echo_p2p.owner init",
        valid_days=valid_days,
        seeded_sampling=True,  # the peers' default: a donor set otherwise (vLLM) is told at join
    )
    local = host == "127.0.0.1"
    boot_identity, listen, maddr = bootstrap_address(workdir, host if local else "0.0.0.0", port)
    announce = None if local else f"/ip4/{host}/tcp/{port}"
    dial = maddr if local else f"{announce}/p2p/{maddr.rsplit('/', 1)[1]}"
    signed = read_file(record)[0]
    join_address = str(JoinAddress(run_id, owner, (dial,), signed.serial))  # who joins refuses older records
    (workdir / "join-address").write_text(join_address + "\n")
    identities = tuple(workdir / "identities" / f"trainer-{i}.id" for i in range(trainers))
    expires_at = signed.expires_at
    return InitializedRun(
        run_id, workdir, owner, record, boot_identity, listen, announce, identities, join_address,
        model, task, mode, expires_at,
    )  # fmt: skip


def python_command() -> str:
    """How to call this interpreter in a printed line: relative to the working directory when inside it."""
    exe = sys.executable
    rel = os.path.relpath(exe)
    return rel if not rel.startswith("..") else exe


def start_lines(run: InitializedRun, python: str | None = None) -> dict[str, list[str]]:
    """The command lines (argument lists) that start the run: ``bootstrap``, ``trainer-<i>``, ``inference``."""
    py = [python or python_command()]
    boot = [*py, "-m", "echo_p2p.bootstrap", "--identity-path", str(run.bootstrap_identity)]
    boot += ["--host-maddrs", run.bootstrap_listen]
    if run.announce:
        boot += ["--announce-maddrs", run.announce]
    boot += ["--run-record", str(run.record)]
    what = ["--model", run.model, "--task", run.task, "--mode", run.mode]
    listen = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"] if run.announce is None else []
    lines = {"bootstrap": boot}
    for i, identity in enumerate(run.trainer_identities):
        lines[f"trainer-{i}"] = [
            *py, "-m", "echo_p2p.peer", "--role", "trainer", "--join", run.join_address,
            "--run-record", str(run.record), "--identity-path", str(identity), *what, *listen,
        ]  # fmt: skip
    lines["inference"] = [*py, "-m", "echo_p2p.peer", "--role", "inference", "--join", run.join_address]
    lines["inference"] += [*what, *listen]
    return lines


def _print_init(run: InitializedRun) -> None:
    lines = {name: shlex.join(args) for name, args in start_lines(run).items()}
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(run.expires_at))
    where = "this machine only" if run.announce is None else f"open TCP port {run.announce.split('/')[-1]}"
    print(f"run {run.run_id}: owner {run.owner}, {len(run.trainer_identities)} trainer(s), "
          f"{run.model} on {run.task} ({run.mode}); record {run.record}, valid until {until}")  # fmt: skip
    print(f"join address: {run.join_address}")
    print(f"\n1. start the bootstrap ({where}); it keeps the run record on the DHT:\n  {lines['bootstrap']}")
    print("\n2. start each trainer (on another machine: copy its identity file and the record there first):")
    for name, line in lines.items():
        if name.startswith("trainer-"):
            print(f"  {line}")
    donor = shlex.join(["bash", "scripts/join.sh", *start_lines(run, "python")["inference"][5:]])
    print("\n3. donors join with one command from a clone of echo_p2p (it sets up .venv the first time):")
    print(f"  {donor}\n  or, with .venv set up:\n  {lines['inference']}")
    print(f"\nkeep {run.workdir / 'identities' / 'owner.id'} off the trainers: it signs the run's records "
          "(python -m echo_p2p.owner sign, to add or remove trainers)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """``init``: make a run's keys, sign its record and print the lines that start it; ``sign``: write a
    signed run record; ``show``: print one and its join address fragment."""
    parser = argparse.ArgumentParser(prog="python -m echo_p2p.owner", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser(
        "init", help="make the run's keys, sign its record, print the join address and the start lines"
    )
    i.add_argument("--run-id", required=True, help="the run's name (1-64 chars of A-Za-z0-9_-)")
    i.add_argument("--trainers", type=int, default=1, help="how many trainer keys to make (default 1)")
    i.add_argument(
        "--dir", default=None, help="where the keys and the record go (default ~/.echo_p2p/runs/RUN_ID)"
    )
    i.add_argument(
        "--host",
        default="127.0.0.1",
        help="the bootstrap machine's public IPv4 address peers dial (default 127.0.0.1: this machine only)",
    )
    i.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"the bootstrap's TCP port (default {DEFAULT_PORT})"
    )
    i.add_argument("--model", choices=["tiny", "smollm2"], default="tiny", help="model preset (default tiny)")
    i.add_argument("--task", default="count", help="the task (default count)")
    i.add_argument("--mode", choices=["sync", "async"], default="async", help="default async")
    i.add_argument("--valid-days", type=float, default=30.0, help="lifetime of the record (default 30 days)")
    s = sub.add_parser("sign", help="sign a run record with the owner's identity")
    s.add_argument("--owner-identity", required=True, help="the owner's identity file (created if missing)")
    s.add_argument("--run-id", required=True)
    s.add_argument("--trainers", required=True, help="a trusted-trainers file (docs/trust.md) listing them")
    s.add_argument("--serial", type=int, default=None, help="default: the signing time in seconds")
    s.add_argument("--valid-days", type=float, default=30.0, help="lifetime of the record (default 30 days)")
    s.add_argument("--model", default=None)
    s.add_argument("--task", default=None)
    s.add_argument("--mode", choices=["sync", "async"], default=None)
    s.add_argument("--temperature", type=float, default=None, help="the run's sampling temperature")
    s.add_argument("--top-p", type=float, default=None, help="the run's sampling top-p")
    s.add_argument("--top-k", type=int, default=None, help="the run's sampling top-k")
    s.add_argument(
        "--sampler-precisions",
        default=None,
        help="comma-separated precisions of samplers whose rollouts count",
    )
    s.add_argument(
        "--seeded-sampling",
        choices=["on", "off"],
        default=None,
        help="on: every rollout is drawn from a seed the trainers replay (the peers' default; vLLM peers "
        "cannot join); off: the run's peers all run with --no-seeded-sampling (default: not said)",
    )
    s.add_argument("--note", default="")
    s.add_argument(
        "--expected-peers",
        type=int,
        default=None,
        help="how many peers the run may grow to: the directory is split into enough bucket keys for it "
        "(default: one key, fine below ~64 inference peers)",
    )
    s.add_argument("--out", required=True, help="where to write the signed record")
    show = sub.add_parser("show", help="verify and print a signed run record")
    show.add_argument("path")
    args = parser.parse_args(argv)
    if args.command == "init":
        from echo_p2p.paths import expand_path

        workdir = Path(expand_path(args.dir or f"~/.echo_p2p/runs/{args.run_id}"))
        try:
            run = init_run(
                args.run_id, workdir, args.trainers, args.host, args.port, args.model, args.task, args.mode,
                args.valid_days,
            )  # fmt: skip
        except ValueError as exc:
            parser.exit(2, f"error: {exc}\n")
        _print_init(run)
        return
    if args.command == "show":
        try:
            record, _, _ = read_file(args.path)
        except ValueError as exc:
            parser.exit(2, f"error: {exc}\n")
        print(record.model_dump_json(indent=2))
        print(
            f"join address: {record.run_id}:{record.owner_peer_id()}@<bootstrap multiaddrs, comma-separated>"
        )
        return
    from echo_p2p.guard.trust import TrustedTrainers, TrustFileError
    from echo_p2p.net.identity import load_or_create_identity

    try:
        trainers = TrustedTrainers.from_file(args.trainers)
        owner = load_or_create_identity(args.owner_identity)
        now = time.time()
        record = RunRecord(
            run_id=validate_run_id(args.run_id),
            owner_key=owner.public_key_bytes().decode(),
            trainers=sorted(trainers.peer_ids),
            serial=int(now) if args.serial is None else args.serial,
            issued_at=now,
            expires_at=now + args.valid_days * 86400,
            model=args.model,
            task=args.task,
            mode=args.mode,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            sampler_precisions=args.sampler_precisions.split(",") if args.sampler_precisions else None,
            seeded_sampling=None if args.seeded_sampling is None else args.seeded_sampling == "on",
            note=args.note,
            directory_buckets=None if args.expected_peers is None else buckets_for(args.expected_peers),
        )
        write_file(args.out, *sign(record, owner))
    except (TrustFileError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"wrote {args.out}: run {record.run_id}, {len(record.trainers)} trainer(s), serial {record.serial}")
    print(f"join address: {record.run_id}:{owner.peer_id}@<bootstrap multiaddrs, comma-separated>")


if __name__ == "__main__":
    main()
