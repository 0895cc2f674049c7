"""``python -m echo_p2p.owner sign|show``: the run owner's tool, to sign the run record (docs/trust.md).

``sign`` writes a signed ``RunRecord`` (the run's trainers, what it trains, a serial and an expiry) with the
owner's identity and prints the join address fragment; the bootstrap and the trainers are started with
``--run-record FILE`` and keep it on the DHT, every other peer joins with ``--join RUN:OWNER@MADDRS``.
``show`` verifies a record file and prints it.
"""

from __future__ import annotations

import argparse
import time

from echo_p2p.net.keys import validate_run_id
from echo_p2p.net.run_record import RunRecord, read_file, sign, write_file


def main(argv: list[str] | None = None) -> None:
    """``sign``: write a signed run record; ``show``: print one and its join address fragment."""
    parser = argparse.ArgumentParser(prog="python -m echo_p2p.owner", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
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
    s.add_argument("--note", default="")
    s.add_argument("--out", required=True, help="where to write the signed record")
    show = sub.add_parser("show", help="verify and print a signed run record")
    show.add_argument("path")
    args = parser.parse_args(argv)
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
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.transport.trust import TrustedTrainers, TrustFileError

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
            note=args.note,
        )
        write_file(args.out, *sign(record, owner))
    except (TrustFileError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"wrote {args.out}: run {record.run_id}, {len(record.trainers)} trainer(s), serial {record.serial}")
    print(f"join address: {record.run_id}:{owner.peer_id}@<bootstrap multiaddrs, comma-separated>")


if __name__ == "__main__":
    main()
