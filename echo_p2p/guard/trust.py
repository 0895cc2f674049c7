"""Which keys a run trusts as trainers, and the check every received policy manifest must pass.

Owned here: the trusted-trainers file format (``--trusted-trainers FILE``, documented in ``docs/trust.md``),
``TrustedTrainers`` (the set of trusted peer ids) and ``check_manifest``, which accepts a manifest only if
its ``publisher_key`` is a well-formed RSA key, the ``publisher`` peer id is the one derived from that key,
that peer id is trusted, and ``Manifest.verify`` passes with the key. Failures return a short reason (the
receiver counts them); nothing here raises on bad input from peers.

File format: one entry per line; ``#`` starts a comment; blank lines are ignored. An entry is either an
OpenSSH RSA public key (``ssh-rsa AAAA... [comment]``, what ``python -m echo_p2p.guard.trust
IDENTITY_FILE`` prints for a trainer) or a libp2p peer id (``Qm...``/``12D3...``, base58). A peer id pins
the key just as well, because the peer id is the hash of the key and every manifest carries its key.
``RunTrust`` is what peers hold: that file, or the run owner's signed run record (``echo_p2p.net.run_record``),
refreshed by the caller from the directory. Callers: ``WeightFetcher`` and ``RolloutPusher`` (inference
peers), the trainer's publisher election, ``swarm status``, tests. Must not do network I/O.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import base58

from echo_p2p.paths import expand_path
from echo_p2p.weights.manifest import Manifest

#: Reasons ``check_manifest`` returns (also the counter names of the receiver).
BAD_PUBLISHER_KEY = "bad_publisher_key"
PUBLISHER_KEY_MISMATCH = "publisher_key_mismatch"
UNTRUSTED_PUBLISHER = "untrusted_publisher"
BAD_SIGNATURE = "bad_signature"
WRONG_RUN = "wrong_run"

_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")  # base58 alphabet


class TrustFileError(ValueError):
    """A trusted-trainers file that cannot be read or has a bad line (the message names file and line)."""


@dataclass(frozen=True)
class TrustedTrainers:
    """The peer ids a run trusts to publish policy versions (its trainers)."""

    peer_ids: frozenset[str] = field(default_factory=frozenset)
    source: str = "(given in code)"

    @classmethod
    def from_keys(cls, keys: Iterable[bytes | str], source: str = "(given in code)") -> TrustedTrainers:
        """From OpenSSH public keys and/or peer ids (``ValueError`` on a bad entry)."""
        ids = set()
        for entry in keys:
            text = entry.decode() if isinstance(entry, bytes) else entry
            ids.add(parse_entry(text))
        return cls(frozenset(ids), source)

    @classmethod
    def from_file(cls, path: str | Path) -> TrustedTrainers:
        """Parse a trusted-trainers file; ``TrustFileError`` with file and line number on any problem."""
        path = Path(expand_path(str(path)))
        try:
            text = path.read_text()
        except OSError as exc:
            raise TrustFileError(f"cannot read trusted-trainers file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise TrustFileError(f"trusted-trainers file {path} is not text") from None
        return cls.from_text(text, source=str(path))

    @classmethod
    def from_text(cls, text: str, source: str = "(text)") -> TrustedTrainers:
        ids = set()
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                ids.add(parse_entry(line))
            except ValueError as exc:
                raise TrustFileError(f"{source}, line {lineno}: {exc}") from None
        if not ids:
            raise TrustFileError(f"{source} lists no trainer: no peer could ever accept a policy")
        return cls(frozenset(ids), source)

    def is_trusted(self, peer_id: str) -> bool:
        return peer_id in self.peer_ids

    def __len__(self) -> int:
        return len(self.peer_ids)


class RunTrust:
    """Whom a peer trusts as the run's trainers now: a fixed list (a trusted-trainers file) or the trainers of
    the newest valid run record signed by the run's owner (``echo_p2p.net.run_record``), which ``update``
    replaces when a record with a higher serial appears (a record that expires trusts nobody any more).
    ``is_trusted`` is all the transports ask; an unconfigured ``RunTrust`` (neither) trusts everyone, for
    trainers of runs that declare no trainers (``configured`` False; the trainer logs it)."""

    def __init__(
        self,
        fixed: TrustedTrainers | None = None,
        owner: str | None = None,
        run_id: str | None = None,
        min_serial: int = 0,
    ) -> None:
        if owner is not None and run_id is None:
            raise ValueError("a run owner needs the run id its record declares")
        self.fixed = fixed
        self.owner = owner
        self.run_id = run_id
        self.min_serial = min_serial  # records below it are refused (the join address's serial)
        self.record = None  # the RunRecord in force (owner mode)
        self.refused: Counter[str] = Counter()  # run records refused, by reason

    @property
    def configured(self) -> bool:
        return self.fixed is not None or self.owner is not None

    def is_trusted(self, peer_id: str) -> bool:
        if self.fixed is not None:
            return self.fixed.is_trusted(peer_id)
        if self.owner is None:
            return True
        record = self.record
        return record is not None and record.expires_at > time.time() and peer_id in record.trainers

    def trusted_ids(self) -> frozenset[str] | None:
        """The peer ids trusted now, or None for anyone (a run that declares no trainers); a run owner's
        record not yet found, or expired, trusts nobody (an empty set)."""
        if self.fixed is not None:
            return self.fixed.peer_ids
        if self.owner is None:
            return None
        record = self.record
        if record is None or record.expires_at <= time.time():
            return frozenset()
        return frozenset(record.trainers)

    def update(self, signed: Iterable, now: float | None = None) -> bool:
        """Apply the newest valid record among ``signed`` (``SignedRunRecord``s) if it is newer than the one in
        force; True when the trusted set changed."""
        if self.owner is None:
            return False
        from echo_p2p.net.run_record import newest_valid

        best, refused = newest_valid(signed, self.run_id, self.owner, now, self.min_serial)
        self.refused.update(refused)
        current = self.record
        if best is None or (
            current is not None and (best.serial, best.issued_at) <= (current.serial, current.issued_at)
        ):
            return False
        self.record = best
        return current is None or set(best.trainers) != set(current.trainers)

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{len(self.fixed)} trainer(s) from {self.fixed.source}"
        if self.owner is None:
            return "every trainer (no trusted trainers configured)"
        if self.record is None:
            return f"no run record of owner {self.owner} yet"
        return f"{len(self.record.trainers)} trainer(s) of run record serial {self.record.serial} (owner {self.owner})"


def parse_entry(text: str) -> str:
    """The peer id of one entry: an OpenSSH RSA public key line or a base58 peer id."""
    parts = text.split()
    if not parts:
        raise ValueError("empty entry")
    if parts[0] == "ssh-rsa":
        if len(parts) < 2:
            raise ValueError("'ssh-rsa' without the key that should follow it")
        from hivemind.utils.crypto import RSAPublicKey

        from echo_p2p.net.identity import peer_id_from_rsa

        try:
            key = RSAPublicKey.from_bytes(f"ssh-rsa {parts[1]}".encode())
        except Exception as exc:  # cryptography raises several types on garbage
            raise ValueError(f"not a valid OpenSSH RSA public key ({type(exc).__name__})") from None
        return peer_id_from_rsa(key)
    if parts[0].startswith("ssh-") or parts[0].startswith("ecdsa-"):
        raise ValueError(f"{parts[0]} keys are not supported: peers sign with RSA keys (ssh-rsa)")
    if len(parts) > 1:
        raise ValueError(f"expected one peer id or an 'ssh-rsa KEY [comment]' line, got {len(parts)} words")
    peer_id = parts[0]
    if not _PEER_ID_RE.match(peer_id):
        raise ValueError(f"{peer_id[:40]!r} is neither an 'ssh-rsa ...' key nor a base58 peer id")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError:
        raise ValueError(f"{peer_id[:40]!r} is not base58") from None
    if len(raw) < 3 or raw[1] != len(raw) - 2:  # a multihash: <code><length><digest>
        raise ValueError(f"{peer_id[:40]!r} is not a libp2p peer id (not a multihash)")
    return peer_id


def check_manifest(manifest: Manifest, trusted: TrustedTrainers, run_id: str | None = None) -> str | None:
    """None if ``manifest`` may be applied; otherwise the reason it must be refused."""
    from hivemind.utils.crypto import RSAPublicKey

    from echo_p2p.net.identity import peer_id_from_rsa

    if run_id is not None and manifest.run_id != run_id:
        return WRONG_RUN
    try:
        key = RSAPublicKey.from_bytes(bytes(manifest.publisher_key))
        key_peer_id = peer_id_from_rsa(key)
    except Exception:
        return BAD_PUBLISHER_KEY
    if key_peer_id != manifest.publisher:
        return PUBLISHER_KEY_MISMATCH
    if not trusted.is_trusted(key_peer_id):
        return UNTRUSTED_PUBLISHER
    if not manifest.verify(key.verify):
        return BAD_SIGNATURE
    return None


def trainer_key_line(identity) -> str:
    """The trusted-trainers line of an ``Identity``: ``ssh-rsa AAAA... <peer id>``."""
    return f"{identity.public_key_bytes().decode()} {identity.peer_id}"


def main(argv: list[str] | None = None) -> None:
    """Print the trusted-trainers line of a trainer's identity file (creates nothing)."""
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.guard.trust",
        description="Print the line to add to a run's --trusted-trainers file for this trainer identity.",
    )
    parser.add_argument("identity_path", help="the trainer's identity file (its --identity-path)")
    args = parser.parse_args(argv)
    from echo_p2p.net.identity import IdentityError, load_or_create_identity

    path = Path(expand_path(args.identity_path))
    if not path.exists():  # never create one here: a new key would not be the trainer's
        parser.error(f"{path} does not exist (start the trainer once with --identity-path to create it)")
    try:
        identity = load_or_create_identity(str(path))
    except IdentityError as exc:
        parser.error(str(exc))
    print(trainer_key_line(identity))


if __name__ == "__main__":
    main()
