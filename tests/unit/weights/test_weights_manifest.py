"""Manifest schema, signing and chunk verification (no torch needed)."""

import hashlib
import hmac

import msgpack
import pytest

from echo_p2p.weights.manifest import (
    ChunkDigestError,
    ChunkIndexError,
    ChunkInfo,
    ChunkSizeError,
    ChunkStore,
    Manifest,
    ParamInfo,
    payload_nbytes,
)

KEY = b"toy-hmac-key"


def hmac_signer(payload: bytes) -> bytes:
    return hmac.new(KEY, payload, hashlib.sha256).digest()


def hmac_verifier(payload: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(hmac_signer(payload), signature)


def make_manifest(chunk_size: int = 100, **overrides) -> tuple[Manifest, list[bytes]]:
    params = [
        ParamInfo(name="a", shape=[20, 3], dtype="float32"),
        ParamInfo(name="b", shape=[7], dtype="int64"),
        ParamInfo(name="c", shape=[], dtype="bfloat16"),
    ]
    total = sum(payload_nbytes(p, "fp32", 4096) for p in params)
    payload = bytes(range(256)) * (total // 256 + 1)
    payload = payload[:total]
    chunks = [payload[i : i + chunk_size] for i in range(0, total, chunk_size)]
    fields = dict(
        run_id="run",
        version=3,
        stream_id="s1",
        encoding="fp32",
        chunk_size=chunk_size,
        params=params,
        chunks=[
            ChunkInfo(index=i, size=len(c), sha256=hashlib.sha256(c).hexdigest())
            for i, c in enumerate(chunks)
        ],
        total_bytes=total,
        publisher="QmPeer",
        publisher_key=b"pubkey",
        created_at=1.5,
    )
    fields.update(overrides)
    return Manifest(**fields), chunks


def test_manifest_bytes_round_trip():
    m, _ = make_manifest()
    m2 = Manifest.from_bytes(m.to_bytes())
    assert m2 == m
    assert m2.to_bytes() == m.to_bytes()
    assert m2.is_keyframe and m2.num_chunks == 3


def test_signing_round_trip_and_tamper_detection():
    m, _ = make_manifest()
    assert not m.verify(hmac_verifier)  # unsigned
    m.sign(hmac_signer)
    received = Manifest.from_bytes(m.to_bytes())
    assert received.verify(hmac_verifier)
    for field, value in [("version", 4), ("publisher", "QmOther"), ("total_bytes", received.total_bytes)]:
        tampered = received.model_copy(deep=True)
        setattr(tampered, field, value)
        assert tampered.verify(hmac_verifier) == (field == "total_bytes")  # unchanged value still verifies
    tampered = received.model_copy(deep=True)
    tampered.chunks[0].sha256 = "0" * 64
    assert not tampered.verify(hmac_verifier)
    assert not received.verify(lambda payload, sig: 1 / 0)  # a raising verifier means "not verified"


def test_signing_payload_is_deterministic_and_excludes_signature():
    m, _ = make_manifest()
    before = m.signing_payload()
    m.sign(hmac_signer)
    assert m.signing_payload() == before
    assert Manifest.from_bytes(m.to_bytes()).signing_payload() == before


def test_unknown_fields_are_ignored_but_stay_signed():
    m, _ = make_manifest()
    obj = msgpack.unpackb(m.to_bytes(), raw=False)
    obj["future_field"] = {"x": 1}
    newer = Manifest.from_bytes(msgpack.packb(obj, use_bin_type=True)).sign(hmac_signer)
    relayed = Manifest.from_bytes(newer.to_bytes())
    assert relayed.verify(hmac_verifier)
    obj = msgpack.unpackb(relayed.to_bytes(), raw=False)
    obj["future_field"] = {"x": 2}
    assert not Manifest.from_bytes(msgpack.packb(obj, use_bin_type=True)).verify(hmac_verifier)


def _mutated(**changes) -> bytes:
    m, _ = make_manifest()
    obj = msgpack.unpackb(m.to_bytes(), raw=False)
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


def _with_chunk(i: int, **changes) -> bytes:
    m, _ = make_manifest()
    obj = msgpack.unpackb(m.to_bytes(), raw=False)
    obj["chunks"][i].update(changes)
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"version": 1}),
        _mutated(version=-1),
        _mutated(version="3"),
        _mutated(base_version=3),  # not < version
        _mutated(base_version=2),  # a base on a full-snapshot encoding
        _mutated(encoding="int8-delta"),  # a delta without base
        _mutated(encoding="fp64"),
        _mutated(protocol=2),
        _mutated(blocksize=100),
        _mutated(total_bytes=999),
        _mutated(chunk_size=10),
        _mutated(publisher_key="not bytes"),
        _mutated(created_at=float("nan")),
        _mutated(params=[{"name": "a", "shape": [-1, 3], "dtype": "float32"}]),
        _mutated(params=[{"name": "a", "shape": [10, 3], "dtype": "complex64"}]),
        _mutated(params=[{"name": "a", "shape": [10, 3], "dtype": "float32"}] * 2),
        _mutated(params=[{"name": "a", "shape": [10, 3], "dtype": "float32"}]),  # layout != total_bytes
        _mutated(chunks=[]),
        _with_chunk(0, index=1),
        _with_chunk(1, size=99),
        _with_chunk(2, size=10**9),
        _with_chunk(0, sha256="XYZ"),
        _with_chunk(0, sha256="A" * 64),
    ],
)
def test_malformed_manifest_bytes_raise_value_error(data):
    with pytest.raises(ValueError):
        Manifest.from_bytes(data)


def test_chunk_store_accepts_valid_chunks_in_any_order():
    m, chunks = make_manifest()
    store = ChunkStore(m)
    assert store.missing() == [0, 1, 2]
    assert store.put(2, chunks[2]) and store.put(0, bytearray(chunks[0]))
    assert not store.put(0, chunks[0])  # duplicate
    assert store.missing() == [1] and not store.is_complete()
    store.put(1, memoryview(chunks[1]))
    assert store.is_complete() and store.get(1) == chunks[1] and store.nbytes == m.total_bytes


@pytest.mark.parametrize(
    "index, mutate, error",
    [
        (0, lambda c: bytes([c[0] ^ 1]) + c[1:], ChunkDigestError),  # corrupted
        (0, lambda c: c[:-1], ChunkSizeError),  # truncated
        (2, lambda c: c + b"\x00", ChunkSizeError),  # too long
        (3, lambda c: c, ChunkIndexError),  # not in the manifest
        (-1, lambda c: c, ChunkIndexError),
    ],
)
def test_chunk_store_rejects_bad_chunks_without_storing(index, mutate, error):
    m, chunks = make_manifest()
    store = ChunkStore(m)
    with pytest.raises(error):
        store.put(index, mutate(chunks[min(max(index, 0), 2)]))
    assert len(store) == 0 and store.missing() == [0, 1, 2]
    with pytest.raises(ValueError):  # every chunk error is a ValueError (WeightsError)
        store.put(index, mutate(chunks[min(max(index, 0), 2)]))
