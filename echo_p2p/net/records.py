"""Typed DHT records of the swarm directory and their validation on the DHT.

Owned here: the pydantic schemas of the records that peers announce (``PeerRecord``,
``ProviderRecord``, ``PolicyRecord``), the rule for unknown fields and other protocol versions, and the
hivemind validators that every echo_p2p node runs so that malformed records are refused at store
time and at read time. Records are stored as plain msgpack maps (``record.to_wire()``); parsing ignores
unknown fields so that newer peers can add fields. Callers: ``directory.py`` and the transports. No network I/O.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, ClassVar, Literal

import msgpack
import pydantic.v1 as pydantic_v1
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from echo_p2p import PROTOCOL_VERSION, __version__
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.rollout import MAX_ABS_REWARD

Role = Literal["inference", "trainer", "bootstrap"]
#: Trainers announce under ``SwarmKeys.trainers``, every other role under ``SwarmKeys.peers`` (a record under
#: the wrong one is refused by echo_p2p nodes and ignored by readers).
TRAINER_ROLES = frozenset({"trainer"})
NON_TRAINER_ROLES = frozenset({"inference", "bootstrap"})
MAX_MADDRS = 16
MAX_STR = 256
#: ``PeerRecord.stalled``: at most this many signal names of at most this many characters (``roles.watchdog``)
MAX_STALLED_SIGNALS = 8
MAX_SIGNAL_CHARS = 32
#: Largest pace a trainer may announce, in policy versions per second (the tiny model moves ~5 on 2 cores).
MAX_VERSIONS_PER_SECOND = 1000.0
#: Largest value any echo_p2p DHT node stores under a run's keys (the records' own bounds are below it; the
#: writer's signature rides in the value, hence the slack).
MAX_VALUE_BYTES = 64 * 1024 + 1024
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
#: Longest lifetime (s) of a directory record. Honest peers re-announce well within it (every ``record_ttl``
#: of the configs is at most this); a record stored to expire later is refused by every echo_p2p DHT node
#: and ignored by every reader, so nothing a peer stores outlives it by more than this.
MAX_RECORD_TTL = 600.0
#: DHT time is wall-clock time: expiries up to this many seconds beyond ``MAX_RECORD_TTL`` are let through.
CLOCK_SKEW = 60.0
#: The only subkey a directory record may have: exactly its owner's ``[owner:ssh-rsa ...]`` marker, so one
#: key holds one record per directory key (hivemind's own rule only asks the subkey to *contain* it: one key
#: could sign any number of records).
OWNER_SUBKEY_RE = re.compile(rb"\[owner:ssh-rsa [A-Za-z0-9+/=]{16,4096}\]\Z")


def is_owner_subkey(subkey: object) -> bool:
    """True when ``subkey`` is exactly one ``[owner:ssh-rsa ...]`` marker and nothing else."""
    return isinstance(subkey, bytes) and OWNER_SUBKEY_RE.match(subkey) is not None


def rule_violation(subkey: object, expiration_time: float, now: float) -> str | None:
    """Why a directory record breaks the run's rules (``bad_subkey``, ``expiry_too_far``), or None. Nodes
    refuse such records at store time (``rules_validator``), readers drop them (``SwarmDirectory``)."""
    if not is_owner_subkey(subkey):
        return "bad_subkey"  # one key, many subkeys: a flood
    if expiration_time > now + MAX_RECORD_TTL + CLOCK_SKEW:
        return "expiry_too_far"  # a record meant to outlive its writer
    return None


def _check_digests(value: list[str]) -> list[str]:
    for digest in value:
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            raise ValueError("a manifest digest must be 64 lower-case hex characters")
    return value


class WireRecord(BaseModel):
    """Base of every DHT record: a protocol version, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)  # no inf/NaN from a stranger

    protocol: int = Field(default=PROTOCOL_VERSION, description="Protocol version of the record's writer")
    #: Largest msgpack encoding a reader parses; the fields' own bounds keep an honest record well below it.
    max_wire_bytes: ClassVar[int] = 8 * 1024

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python")

    @classmethod
    def from_wire(cls, value: Any) -> WireRecord:
        """Parse an untrusted DHT value; raises ``RecordError`` with a reason on any problem."""
        if not isinstance(value, dict):
            raise RecordError(f"{cls.__name__} must be a map, got {type(value).__name__}")
        protocol = value.get("protocol")
        if type(protocol) is not int:
            raise RecordError(f"{cls.__name__} has no integer 'protocol' field")
        if protocol != PROTOCOL_VERSION:
            raise OtherProtocolError(protocol)
        try:
            size = len(msgpack.packb(value, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as exc:
            raise RecordError(f"{cls.__name__} is not plain data ({type(exc).__name__})") from None
        if size > cls.max_wire_bytes:
            raise OversizedRecordError(f"{cls.__name__} of {size} bytes (at most {cls.max_wire_bytes})")
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            raise RecordError(f"malformed {cls.__name__}: {_short(exc)}") from exc


class RecordError(ValueError):
    """A DHT record that does not parse (malformed, wrong types, out of range)."""


class OversizedRecordError(RecordError):
    """A DHT record larger than its class's ``max_wire_bytes``: dropped unparsed, counted as ``too_large``."""


class OtherProtocolError(RecordError):
    """A record written by a peer of another protocol version: ignored, logged once."""

    def __init__(self, protocol: int):
        super().__init__(
            f"record of protocol version {protocol} (this peer speaks {PROTOCOL_VERSION}; "
            "the peer with the older one must update echo_p2p)"
        )
        self.protocol = protocol


def _short(exc: ValidationError) -> str:
    errors = exc.errors()
    parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors[:3]]
    return "; ".join(parts) + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")


SignalName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_SIGNAL_CHARS)]
Maddr = Annotated[str, StringConstraints(max_length=MAX_STR)]
Encoding = Annotated[str, StringConstraints(max_length=32)]


class PeerRecord(WireRecord):
    """What a peer announces about itself (subkey: its own public key): under ``SwarmKeys.trainers`` for a
    trainer, ``SwarmKeys.peers`` for the other roles."""

    peer_id: str = Field(max_length=128, description="libp2p peer id (base58); must match the signing key")
    role: Role = Field(description="The peer's role in the run")
    software_version: str = Field(default=__version__, max_length=64, description="echo_p2p version")
    mode: Literal["sync", "async"] | None = Field(default=None, description="Sync mode the peer runs in")
    policy_version: int | None = Field(default=None, ge=0, description="Newest complete policy version held")
    maddrs: list[Maddr] = Field(default_factory=list, max_length=MAX_MADDRS, description="Multiaddrs to dial")
    started_at: float = Field(default_factory=time.time, description="Wall-clock start time of the peer")
    updated_at: float = Field(default_factory=time.time, description="Wall-clock time of this announcement")
    state: Literal["starting", "running", "leaving"] = Field(
        default="running", description="Life-cycle state"
    )
    stalled: list[SignalName] | None = Field(
        default=None,
        max_length=MAX_STALLED_SIGNALS,
        description="Progress signals of its watchdog overdue now (e.g. announce, training); None: none",
    )
    # role figures (inference): filled by the inference peer
    tokens_per_second: float | None = Field(default=None, ge=0, description="Sampling throughput (inference)")
    rollouts_per_second: float | None = Field(
        default=None, ge=0, description="Rollout groups sent or consumed per s"
    )
    # role figures (trainer): filled by the trainer peer
    free_buffer_room: int | None = Field(
        default=None, ge=0, description="Rollout groups the trainer can accept"
    )
    accepts_rollouts: bool | None = Field(
        default=None, description="Trainer: whether it ingests pushed rollouts"
    )
    # figures for monitors (``swarm status``, ``echo_p2p.monitor``): shown, never acted upon by peers
    buffered_groups: int | None = Field(
        default=None, ge=0, description="Trainer (async): rollout groups in its replay buffer"
    )
    max_staleness: int | None = Field(
        default=None, ge=0, le=1024, description="Trainer: oldest rollouts it trains on, in versions"
    )
    rollouts_consumed: int | None = Field(
        default=None, ge=0, description="Trainer: rollout groups trained on since it started"
    )
    reward_mean: float | None = Field(
        default=None,
        ge=-MAX_ABS_REWARD,
        le=MAX_ABS_REWARD,
        allow_inf_nan=False,
        description="Trainer: mean re-scored reward of its last (up to 10) steps (any scale, within the wire "
        "bound of a reward, ±1e6)",
    )
    chunks_served: int | None = Field(
        default=None, ge=0, description="Policy chunks this peer served to others since it started"
    )
    versions_per_second: float | None = Field(
        default=None,
        ge=0,
        le=MAX_VERSIONS_PER_SECOND,
        allow_inf_nan=False,
        description="Trainer: policy versions per second over its last 30 s of steps; the publisher election's "
        "pace, read from the records so that every trainer judges with the same one",
    )
    eval_version: int | None = Field(
        default=None,
        ge=0,
        description="Trainer (the publisher): policy version of its last held-out evaluation",
    )
    eval_accuracy: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Trainer: share of the held-out prompts its greedy completion answered exactly",
    )
    eval_reward: float | None = Field(
        default=None,
        ge=-MAX_ABS_REWARD,
        le=MAX_ABS_REWARD,
        allow_inf_nan=False,
        description="Trainer: mean reward of completions sampled on the held-out prompts",
    )
    waiting_for_grants: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Inference (async): share of its recent time spent waiting for a trainer's grant (pacing); "
        "near 1, the run needs no more samplers",
    )


class ProviderRecord(WireRecord):
    """Under ``SwarmKeys.providers`` of its bucket, in the slot of each version it offers (subkey: the
    provider's key): policy versions a peer holds and serves."""

    max_wire_bytes: ClassVar[int] = 16 * 1024

    peer_id: str = Field(max_length=128, description="libp2p peer id (base58) of the provider")
    versions: list[int] = Field(
        default_factory=list, max_length=64, description="Complete versions it serves"
    )
    encodings: list[Encoding] = Field(default_factory=list, max_length=16, description="Encodings it serves")
    maddrs: list[Maddr] = Field(default_factory=list, max_length=MAX_MADDRS, description="Multiaddrs to dial")
    stream_id: str | None = Field(
        default=None, max_length=64, description="Publisher stream the served manifests belong to"
    )
    manifests: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="sha256 (hex) of the manifests whose every chunk it holds and serves",
    )
    partial: list[str] = Field(
        default_factory=list,
        max_length=16,
        description="sha256 (hex) of manifests it is fetching now; it serves the chunks it already holds",
    )

    @field_validator("manifests", "partial")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        return _check_digests(value)


class ManifestRef(BaseModel):
    """A pointer to one signed manifest of a publisher's stream (the manifest itself travels by RPC)."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)  # no inf/NaN from a stranger

    version: int = Field(ge=0, description="Policy version the manifest encodes")
    base_version: int | None = Field(
        default=None, ge=0, description="Version a delta applies to; None: keyframe"
    )
    digest: str = Field(description="sha256 (hex) of the manifest's bytes (Manifest.to_bytes())")
    encoding: str = Field(max_length=32, description="Payload encoding (fp32, bf16, int8, int8-delta)")
    total_bytes: int = Field(ge=0, description="Payload size of the version in bytes")
    num_chunks: int = Field(ge=0, description="Number of chunks")

    @field_validator("digest")
    @classmethod
    def _digest(cls, value: str) -> str:
        return _check_digests([value])[0]


class PolicyRecord(WireRecord):
    """Under ``SwarmKeys.policy`` (subkey: the publisher's key): a trainer's newest published policy.

    Small on purpose: the manifests of the publisher's current chain (newest keyframe and the deltas that
    follow it) are listed by digest only; receivers fetch them with ``rpc_get_manifests`` and accept one
    only if its signature and publisher are trusted (``echo_p2p.guard.trust``).
    """

    max_wire_bytes: ClassVar[int] = 32 * 1024

    peer_id: str = Field(max_length=128, description="libp2p peer id (base58) of the publisher")
    stream_id: str = Field(min_length=1, max_length=64, description="Publisher's current encoder stream")
    version: int = Field(ge=0, description="Newest published version")
    keyframe_version: int | None = Field(
        default=None, ge=0, description="Version of the newest full snapshot (keyframe) it serves"
    )
    manifests: list[ManifestRef] = Field(
        default_factory=list, max_length=64, description="Manifests it serves, oldest first"
    )
    maddrs: list[Maddr] = Field(default_factory=list, max_length=MAX_MADDRS, description="Multiaddrs to dial")
    updated_at: float = Field(default_factory=time.time, description="Wall-clock time of this announcement")


MAX_RUN_RECORD_BYTES = 16 * 1024
MAX_SIGNATURE_BYTES = 1024


class SignedRunRecord(WireRecord):
    """Under ``SwarmKeys.run`` (subkey: the storer's key): the run owner's signed ``RunRecord``, re-stored by
    any peer that holds it; readers verify the owner's signature themselves (``echo_p2p.net.run_record``)."""

    max_wire_bytes: ClassVar[int] = MAX_RUN_RECORD_BYTES + MAX_SIGNATURE_BYTES + 1024

    peer_id: str = Field(max_length=128, description="Peer id of the peer that stored it (not the owner)")
    record: bytes = Field(max_length=MAX_RUN_RECORD_BYTES, description="RunRecord.to_bytes()")
    signature: bytes = Field(
        max_length=MAX_SIGNATURE_BYTES, description="The owner's signature of the record"
    )


class Ban(BaseModel):
    """One banned peer in a ``BanRecord``."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)  # no inf/NaN from a stranger

    peer_id: str = Field(max_length=128, description="The banned peer")
    until: float = Field(description="Wall-clock end of the ban (receivers cap it at their own ban length)")
    reason: str = Field(default="", max_length=32, description="Why (e.g. logprob_gap)")


class BanRecord(WireRecord):
    """Under ``SwarmKeys.bans`` (subkey: the trainer's key): the senders a trainer banned. Peers apply the
    bans of the run's trusted trainers only."""

    max_wire_bytes: ClassVar[int] = 64 * 1024

    peer_id: str = Field(max_length=128, description="Peer id of the trainer that banned them")
    bans: list[Ban] = Field(default_factory=list, max_length=256, description="Bans in force, longest first")
    updated_at: float = Field(default_factory=time.time, description="Wall-clock time of this announcement")


class _DhtValue:
    """A pydantic-v1 type for hivemind's SchemaValidator: checks a value against one of our records.

    hivemind compares the parsed value with the raw one and refuses any conversion, so this type returns
    the raw map unchanged. Records of another protocol version are let through (they are that version's
    business; readers of this version ignore them with a log line).
    """

    record_cls: type[WireRecord] = WireRecord
    roles: frozenset[str] | None = None  # the roles a PeerRecord may have under this key (None: any)

    @classmethod
    def __get_validators__(cls):
        yield cls.validate

    @classmethod
    def validate(cls, value: Any) -> Any:
        try:
            record = cls.record_cls.from_wire(value)
        except OtherProtocolError:
            return value
        except RecordError as exc:
            raise ValueError(str(exc)) from exc
        if cls.roles is not None and getattr(record, "role", None) not in cls.roles:
            raise ValueError(f"a {record.role} record does not belong under this key")
        return value


def _value_type(record_cls: type[WireRecord], roles: frozenset[str] | None = None) -> type:
    name = f"DHT{record_cls.__name__}{''.join(sorted(roles or ()))}"
    return type(name, (_DhtValue,), {"record_cls": record_cls, "roles": roles})


def schema_validator(keys: SwarmKeys):
    """The hivemind ``SchemaValidator`` for one run's keys: dictionary records whose subkey is exactly their
    owner's public-key marker (``OWNER_SUBKEY_RE``). Every bucket key (``SwarmKeys.bucket_keys``) is checked
    against the schema of its kind: hivemind names one schema field per raw key, so the bucket keys' hashes
    are mapped onto the field of the first bucket of their kind."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.schema import SchemaValidator, conbytes

    owner = conbytes(regex=OWNER_SUBKEY_RE.pattern)
    first = {"peers": keys.peers(1, 0), "providers": keys.providers(1, 0, 0)}
    fields = {
        first["peers"]: (dict[owner, _value_type(PeerRecord, NON_TRAINER_ROLES)], None),
        keys.trainers: (dict[owner, _value_type(PeerRecord, TRAINER_ROLES)], None),
        first["providers"]: (dict[owner, _value_type(ProviderRecord)], None),
        keys.policy: (dict[owner, _value_type(PolicyRecord)], None),
        keys.run: (dict[owner, _value_type(SignedRunRecord)], None),
        keys.bans: (dict[owner, _value_type(BanRecord)], None),
    }
    schema = pydantic_v1.create_model(f"EchoSchema_{keys.protocol}", **fields)
    validator = SchemaValidator(schema, allow_extra_keys=True)
    for raw_key, kind in keys.bucket_keys().items():
        validator._key_id_to_field_name[DHTID.generate(source=raw_key).to_bytes()] = first[kind]
    return validator


def rules_validator(keys: SwarmKeys):
    """A hivemind record validator for the run's keys, run *before* the signature check (a higher priority
    than ``RSASignatureValidator``'s 10), so that what it refuses costs no RSA verification: values above
    ``MAX_VALUE_BYTES``, subkeys other
    than exactly their owner's key marker (``OWNER_SUBKEY_RE``: a flood from one key) and records stored to
    expire more than ``MAX_RECORD_TTL`` (+ ``CLOCK_SKEW``) from now (a record meant to outlive its writer)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import RecordValidatorBase
    from hivemind.utils import MSGPackSerializer, get_dht_time

    raw_keys = [*keys.all_keys().values(), *keys.bucket_keys()]
    key_ids = frozenset(DHTID.generate(source=key).to_bytes() for key in raw_keys)

    class RulesValidator(RecordValidatorBase):
        def validate(self, record) -> bool:
            if record.key not in key_ids:
                return True
            if len(record.value) > MAX_VALUE_BYTES:
                return False
            try:
                subkey = MSGPackSerializer.loads(record.subkey)
            except Exception:
                return False
            return rule_violation(subkey, record.expiration_time, get_dht_time()) is None

        @property
        def priority(self) -> int:
            return 20

    return RulesValidator()
