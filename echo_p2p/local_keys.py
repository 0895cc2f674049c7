"""The keys and addresses a run's owner makes before any process starts (``python -m echo_p2p.owner init``
and the local runner, ``python -m echo_p2p.local``).

Owned here: the trainers' identities and trusted-trainers file, the run owner's identity and the signed run
record, and the bootstrap's identity and listening address, all under the run's ``workdir``. Knowing the
bootstrap's address before it runs gives the join address up front, and lets the local runner start every
process at once: peers import and load their models while the bootstrap starts, and knock
(``net.node.JOIN_RETRY``) until it listens.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

#: Lowest port tried for the bootstrap; the range ends below the kernel's ephemeral ports, which it hands
#: to outgoing connections and to listeners on port 0, so no other process is given the chosen port.
FIRST_PORT = 20000


def make_trainer_identities(workdir: Path, trainers: int) -> Path:
    """Create the trainers' identities up front and the run's trusted-trainers file from them."""
    from echo_p2p.guard.trust import trainer_key_line
    from echo_p2p.net.identity import load_or_create_identity

    lines = ["# trainers of this local run (python -m echo_p2p.guard.trust IDENTITY prints a line)"]
    for i in range(trainers):
        identity = load_or_create_identity(str(workdir / "identities" / f"trainer-{i}.id"))
        lines.append(trainer_key_line(identity))
    path = workdir / "trusted-trainers.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_run_record(
    workdir: Path,
    run_id: str,
    trainers: int,
    model: str,
    task: str,
    mode: str,
    note: str = "a local run (python -m echo_p2p.local)",
    valid_days: float = 30.0,
    seeded_sampling: bool | None = None,
) -> tuple[Path, str]:
    """Sign the run record (its trainers, model, task, mode, and ``seeded_sampling`` when given) with the run-owner identity under ``workdir``
    (created when missing, kept otherwise), as ``python -m echo_p2p.owner sign`` does; returns the record
    file and the owner's peer id."""
    from echo_p2p.guard.trust import TrustedTrainers
    from echo_p2p.net import run_record
    from echo_p2p.net.identity import load_or_create_identity

    trusted = TrustedTrainers.from_file(make_trainer_identities(workdir, trainers))
    owner = load_or_create_identity(str(workdir / "identities" / "owner.id"))
    now = time.time()
    record = run_record.RunRecord(
        run_id=run_id,
        owner_key=owner.public_key_bytes().decode(),
        trainers=sorted(trusted.peer_ids),
        serial=int(now),
        issued_at=now,
        expires_at=now + valid_days * 86400,
        model=model,
        task=task,
        mode=mode,
        seeded_sampling=seeded_sampling,
        note=note,
    )
    path = workdir / "run-record.bin"
    run_record.write_file(path, *run_record.sign(record, owner))
    return path, owner.peer_id


def bootstrap_address(
    workdir: Path, host: str = "127.0.0.1", port: int | None = None
) -> tuple[Path, str, str]:
    """The bootstrap's identity file, the multiaddr it listens on and the one peers dial (with its
    ``/p2p/`` part), chosen before it starts: ``port``, or a free port below the ephemeral range."""
    from echo_p2p.net.identity import load_or_create_identity

    path = workdir / "identities" / "bootstrap.id"
    identity = load_or_create_identity(str(path))
    port = free_port_below_ephemeral(host) if port is None else port
    listen = f"/ip4/{host}/tcp/{port}"
    return path, listen, f"{listen}/p2p/{identity.peer_id}"


def free_port_below_ephemeral(host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port between ``FIRST_PORT`` and the first ephemeral port that nothing listens on now."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(attempts):
        port = rng.randrange(FIRST_PORT, max(FIRST_PORT + 1, low))
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between {FIRST_PORT} and {low} on {host}")
