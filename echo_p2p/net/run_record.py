"""The run record: the run owner's signed statement of which keys are the run's trainers.

An open run lets anyone announce a ``PeerRecord`` with ``role: trainer``; whom to push rollouts to, whom to
elect as the publisher and whose weights to apply cannot depend on that. The run's owner (the person who
starts the run; a key of its own, usually kept off the trainers) signs one ``RunRecord``: the run id, the
trainers' peer ids, what the run trains (model, task, mode), a serial number and an expiry. Peers join
with one address (``JoinAddress``: run id, the owner key's peer id, bootstrap multiaddrs) and trust
exactly the trainers of the newest valid record signed by that key.

The signed record travels as a ``SignedRunRecord`` under ``SwarmKeys.run``: any peer holding the record file
(the bootstrap, the trainers) re-stores it under its own subkey, and readers check the owner's signature
themselves, so a stranger can store garbage there (one record per key, like every directory key) but
cannot forge or hide a valid one. A newer serial replaces an older one; an expired record trusts nobody.

Owned here: the schemas, canonical bytes, signing and verification, choosing the newest valid record, what
is wrong when a joining peer finds no valid one (``explain_missing``: a wrong owner or run id, an expired or
unsigned record, each with its fix), the join address, and the record file (written by ``python -m echo_p2p.owner sign``). No network I/O: the
directory stores and reads the ``SignedRunRecord``s, ``guard.trust.RunTrust`` applies them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from echo_p2p.net.buckets import ALLOWED_BUCKETS
from echo_p2p.net.keys import validate_run_id
from echo_p2p.net.records import MAX_RUN_RECORD_BYTES as MAX_RECORD_BYTES
from echo_p2p.net.records import MAX_SIGNATURE_BYTES, MAX_STR, SignedRunRecord
from echo_p2p.paths import expand_path

#: Signatures over run records carry this prefix (a signature made for a manifest cannot be replayed here).
SIGNING_DOMAIN = b"echo_p2p/run/v1\x00"
MAX_TRAINERS = 64
_PEER_ID_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")

#: Reasons ``verify`` returns (also counter names).
MALFORMED = "malformed"
BAD_OWNER_KEY = "bad_owner_key"
WRONG_OWNER = "wrong_owner"
BAD_SIGNATURE = "bad_signature"
WRONG_RUN = "wrong_run"
EXPIRED = "expired"
OLDER_THAN_KNOWN = "older_than_known"  # a serial below the one the join address names
#: Largest serial a join address may name (a signed 64-bit integer).
MAX_SERIAL = 2**63 - 1


class RunRecord(BaseModel):
    """What the run owner signs."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)  # no inf/NaN from a stranger

    run_id: str = Field(max_length=64, description="The run this record declares")
    owner_key: str = Field(max_length=2048, description="The owner's OpenSSH RSA public key (ssh-rsa ...)")
    trainers: list[str] = Field(
        min_length=1, max_length=MAX_TRAINERS, description="Peer ids of the run's trainers"
    )
    serial: int = Field(ge=0, description="A newer record of the same owner has a higher serial")
    issued_at: float = Field(description="Wall-clock time of signing")
    expires_at: float = Field(description="Wall-clock time after which the record trusts nobody")
    model: str | None = Field(default=None, max_length=128, description="Model preset or name the run trains")
    task: str | None = Field(default=None, max_length=64, description="Task the run trains on")
    mode: Literal["sync", "async"] | None = Field(default=None, description="Synchronisation mode")
    temperature: float | None = Field(default=None, description="Sampling temperature of the run")
    top_p: float | None = Field(default=None, description="Sampling top-p of the run")
    top_k: int | None = Field(default=None, description="Sampling top-k of the run")
    sampler_precisions: list[str] | None = Field(
        default=None, max_length=8, description="Weight precisions of samplers whose rollouts count"
    )
    seeded_sampling: bool | None = Field(
        default=None,
        description="Whether every rollout must be drawn from a seed the trainers replay "
        "(``RunSettings.seeded_sampling``: a peer set otherwise is refused at join); None: not said",
    )
    note: str = Field(default="", max_length=MAX_STR, description="Free text for people (who runs it)")
    directory_buckets: int | None = Field(
        default=None,
        description="K, the directory's bucket keys (``net.buckets``: one of 1, 4, 16, 64, 256; None: 1), "
        "chosen from the peers the owner expects",
    )

    @field_validator("trainers")
    @classmethod
    def _peer_ids(cls, value: list[str]) -> list[str]:
        for peer_id in value:
            if not isinstance(peer_id, str) or not _PEER_ID_RE.match(peer_id):
                raise ValueError("a trainer must be a base58 peer id")
        return value

    @field_validator("directory_buckets")
    @classmethod
    def _buckets(cls, value: int | None) -> int | None:
        if value is not None and value not in ALLOWED_BUCKETS:
            raise ValueError(f"directory_buckets must be one of {ALLOWED_BUCKETS}")
        return value

    @field_validator("issued_at", "expires_at")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("times must be finite")
        return value

    def signing_payload(self) -> bytes:
        return SIGNING_DOMAIN + self.to_bytes()

    def to_bytes(self) -> bytes:
        body = self.model_dump(mode="python")
        if (
            body["directory_buckets"] is None
        ):  # absent as before the field existed: old signatures still verify
            del body["directory_buckets"]
        return msgpack.packb({k: body[k] for k in sorted(body)}, use_bin_type=True)

    def owner_peer_id(self) -> str:
        return peer_id_of_key(self.owner_key)


def peer_id_of_key(owner_key: str) -> str:
    """Peer id of an OpenSSH RSA public key (``ValueError`` on a bad key)."""
    from hivemind.utils.crypto import RSAPublicKey

    from echo_p2p.net.identity import peer_id_from_rsa

    try:
        return peer_id_from_rsa(RSAPublicKey.from_bytes(owner_key.encode()))
    except Exception as exc:  # cryptography raises several types on garbage
        raise ValueError(f"not an OpenSSH RSA public key ({type(exc).__name__})") from None


def sign(record: RunRecord, owner_identity) -> tuple[bytes, bytes]:
    """``(record bytes, signature)`` signed with the owner's identity (whose key must be ``owner_key``)."""
    if owner_identity.public_key_bytes().decode() != record.owner_key:
        raise ValueError("the record's owner_key is not this identity's key")
    return record.to_bytes(), owner_identity.private_key.sign(record.signing_payload())


def verify(
    record_bytes: bytes, signature: bytes, run_id: str, owner: str, now: float | None = None
) -> RunRecord | str:
    """The record if ``owner`` (a peer id) signed it for ``run_id`` and it has not expired, else the reason."""
    from hivemind.utils.crypto import RSAPublicKey

    try:
        if len(record_bytes) > MAX_RECORD_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
            return MALFORMED
        body = msgpack.unpackb(record_bytes, raw=False, strict_map_key=True)
        record = RunRecord.model_validate(body)
    except (
        ValueError,
        ValidationError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ):
        return MALFORMED
    try:
        key = RSAPublicKey.from_bytes(record.owner_key.encode())
        key_owner = peer_id_of_key(record.owner_key)
    except Exception:
        return BAD_OWNER_KEY
    if key_owner != owner:
        return WRONG_OWNER
    if record.to_bytes() != record_bytes or not key.verify(record.signing_payload(), signature):
        return BAD_SIGNATURE
    if record.run_id != run_id:
        return WRONG_RUN
    if record.expires_at <= (time.time() if now is None else now):
        return EXPIRED
    return record


def newest_valid(
    signed: Iterable[SignedRunRecord], run_id: str, owner: str, now: float | None = None, min_serial: int = 0
) -> tuple[RunRecord | None, dict[str, int]]:
    """The valid record with the highest serial (then the latest issue time) and the refusals by reason;
    a record below ``min_serial`` (the serial the join address names) is refused (``older_than_known``):
    an eclipse serving only an older record cannot roll the trusted trainers back."""
    best: RunRecord | None = None
    refused: dict[str, int] = {}
    for item in signed:
        result = verify(item.record, item.signature, run_id, owner, now)
        if not isinstance(result, str) and result.serial < min_serial:
            result = OLDER_THAN_KNOWN
        if isinstance(result, str):
            refused[result] = refused.get(result, 0) + 1
            continue
        if best is None or (result.serial, result.issued_at) > (best.serial, best.issued_at):
            best = result
    return best, refused


#: How to fix each refusal of a record, for people (``explain_missing``, ``read_file``).
RESIGN = "the owner signs a new one (python -m echo_p2p.owner init again, or owner sign) and restarts the bootstrap with it"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _signer(item: SignedRunRecord) -> tuple[str | None, RunRecord | None]:
    """The peer id of the key a stored copy claims as its owner, and the record (None where unreadable)."""
    try:
        record = RunRecord.model_validate(msgpack.unpackb(item.record, raw=False, strict_map_key=True))
        return peer_id_of_key(record.owner_key), record
    except Exception:
        return None, None


def explain_missing(
    signed: Iterable[SignedRunRecord], run_id: str, owner: str, now: float | None = None, min_serial: int = 0
) -> str:
    """Why no valid record of ``run_id`` signed by ``owner`` (with a serial of at least ``min_serial``, the
    join address's) is among ``signed`` (every copy stored under the run's key, read by a node that refuses
    none), and how to fix it: one line for a person."""
    now = time.time() if now is None else now
    items = list(signed)
    if not items:
        return (
            f"no run named {run_id!r} on this bootstrap: nothing is stored under that run id (check the run id "
            "of your --join address; the owner's bootstrap prints the run's address, and keeps its record only "
            "when started with --run-record)"
        )
    reasons = [(verify(i.record, i.signature, run_id, owner, now), *_signer(i)) for i in items]
    others = sorted({who for reason, who, _ in reasons if reason == WRONG_OWNER and who})
    if others:
        return (
            f"the run's record is signed by {', '.join(others)}, not by the owner {owner} of your address: "
            f"check the owner part of --join {run_id}:OWNER@... (the bootstrap prints the run's whole address)"
        )
    older = [r for r in reasons if isinstance(r[0], RunRecord) and r[0].serial < min_serial]
    if older:
        newest = max(r[0].serial for r in older)
        return (
            f"the run record of {run_id!r} found has serial {newest}, older than the serial {min_serial} your "
            "address names: this bootstrap serves an old record (or hides the newer one); ask the owner for "
            "the run's current address, or join through another bootstrap"
        )
    expired = [record for reason, _, record in reasons if reason == EXPIRED and record is not None]
    if expired:
        last = max(r.expires_at for r in expired)
        return (
            f"the run record of {run_id!r} expired at {_when(last)} (this machine's clock: {_when(now)}): "
            f"{RESIGN}; if the date is right and your clock is not, set your clock"
        )
    wrong_run = sorted({r.run_id for reason, _, r in reasons if reason == WRONG_RUN and r is not None})
    if wrong_run:
        return f"the record stored under run {run_id!r} declares run {', '.join(wrong_run)}: {RESIGN}"
    found = sorted({reason for reason, _, _ in reasons if isinstance(reason, str)})
    return (
        f"the run record of {run_id!r} is not validly signed by {owner} ({', '.join(found)}: altered, or not "
        f"signed by the owner key): {RESIGN}"
    )


# ---- the join address ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JoinAddress:
    """``RUN_ID:OWNER_PEER_ID@MADDR[,MADDR...][#SERIAL]``: everything a peer needs to join a run and trust it.

    ``SERIAL`` (optional; addresses without it still parse) is the serial of the run record in force when the
    address was made: a peer joining with it refuses any older record (``older_than_known``)."""

    run_id: str
    owner: str
    initial_peers: tuple[str, ...]
    min_serial: int = 0

    @classmethod
    def parse(cls, text: str) -> JoinAddress:
        text, hash_, serial_text = text.strip().partition("#")
        min_serial = 0
        if hash_:
            if not serial_text.isdigit() or len(serial_text) > 19 or int(serial_text) > MAX_SERIAL:
                raise ValueError(
                    f"the run record serial after '#' must be an integer, got {serial_text[:24]!r}"
                )
            min_serial = int(serial_text)
        head, sep, tail = text.partition("@")
        run_id, colon, owner = head.partition(":")
        if not sep or not colon:
            raise ValueError(f"a join address is RUN_ID:OWNER_PEER_ID@MADDR[,MADDR...], got {text[:80]!r}")
        validate_run_id(run_id)
        if not _PEER_ID_RE.match(owner):
            raise ValueError(f"{owner[:60]!r} is not a base58 peer id (the run owner's)")
        maddrs = tuple(m for m in tail.split(",") if m)
        if not maddrs or not all(m.startswith("/") for m in maddrs):
            raise ValueError(
                "a join address needs at least one multiaddr after '@' (e.g. /ip4/.../tcp/.../p2p/...)"
            )
        return cls(run_id, owner, maddrs, min_serial)

    def __str__(self) -> str:
        serial = f"#{self.min_serial}" if self.min_serial else ""
        return f"{self.run_id}:{self.owner}@{','.join(self.initial_peers)}{serial}"


# ---- the record file -------------------------------------------------------------------------------------
def write_file(path: str | Path, record_bytes: bytes, signature: bytes) -> None:
    Path(path).write_bytes(msgpack.packb({"record": record_bytes, "signature": signature}, use_bin_type=True))


def read_file(path: str | Path) -> tuple[RunRecord, bytes, bytes]:
    """``(record, record bytes, signature)`` of a signed record file whose signature verifies with the key
    inside it (``ValueError`` with the reason otherwise; an expired record is refused too)."""
    try:
        data = msgpack.unpackb(Path(expand_path(str(path))).read_bytes(), raw=False)
        record_bytes, signature = bytes(data["record"]), bytes(data["signature"])
        record = RunRecord.model_validate(msgpack.unpackb(record_bytes, raw=False))
    except OSError as exc:
        raise ValueError(f"cannot read run record {path}: {exc.strerror or exc}") from None
    except Exception as exc:
        raise ValueError(f"{path} is not a signed run record ({type(exc).__name__})") from None
    result = verify(record_bytes, signature, record.run_id, peer_id_of_key(record.owner_key))
    if result == EXPIRED:
        raise ValueError(f"run record {path} expired at {_when(record.expires_at)}: {RESIGN}")
    if isinstance(result, str):
        raise ValueError(
            f"run record {path} refused: {result} (altered, or not signed by its owner key): {RESIGN}"
        )
    return result, record_bytes, signature
