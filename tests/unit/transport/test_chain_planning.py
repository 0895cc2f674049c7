"""Which manifests a receiver fetches: deltas from exactly what it holds, else keyframe + deltas."""

from __future__ import annotations

import pytest

from echo_p2p.net.records import ManifestRef, PolicyRecord
from echo_p2p.transport.weights.fetch.chain import PlanError, plan_chain


def ref(version: int, base: int | None) -> ManifestRef:
    digest = f"{version:02d}{'k' if base is None else base:>2}".replace(" ", "0").replace("k", "f")
    return ManifestRef(
        version=version,
        base_version=base,
        digest=(digest * 16)[:64],
        encoding="fp32" if base is None else "int8-delta",
        total_bytes=400 if base is None else 100,
        num_chunks=1,
    )


def record(*refs: ManifestRef, stream: str = "s1") -> PolicyRecord:
    return PolicyRecord(
        peer_id="QmTrainer",
        stream_id=stream,
        version=max(r.version for r in refs),
        keyframe_version=max((r.version for r in refs if r.base_version is None), default=None),
        manifests=list(refs),
    )


# what a publisher with keyframe_interval 5 serves at version 12: keyframe 10, deltas 10 (base 9), 11, 12
CHAIN_AT_12 = record(ref(10, 9), ref(10, None), ref(11, 10), ref(12, 11))


def versions(chain):
    return [(r.version, r.base_version) for r in chain]


def test_follower_takes_the_deltas_from_the_exact_version_it_holds():
    assert versions(plan_chain(CHAIN_AT_12, ("s1", 11))) == [(12, 11)]
    assert versions(plan_chain(CHAIN_AT_12, ("s1", 9))) == [(10, 9), (11, 10), (12, 11)]


def test_newcomer_takes_the_newest_keyframe_and_the_deltas_after_it():
    assert versions(plan_chain(CHAIN_AT_12, None)) == [(10, None), (11, 10), (12, 11)]


def test_a_version_outside_the_chain_or_of_another_stream_restarts_from_the_keyframe():
    assert versions(plan_chain(CHAIN_AT_12, ("s1", 7))) == [(10, None), (11, 10), (12, 11)]
    assert versions(plan_chain(CHAIN_AT_12, ("s0", 11))) == [(10, None), (11, 10), (12, 11)]


def test_nothing_to_fetch_when_already_at_or_past_the_version():
    assert plan_chain(CHAIN_AT_12, ("s1", 12)) == []
    assert plan_chain(CHAIN_AT_12, ("s1", 13)) == []


def test_snapshot_encodings_fetch_the_newest_snapshot():
    assert versions(plan_chain(record(ref(4, None)), ("s1", 3))) == [(4, None)]


def test_no_chain_to_the_newest_version_is_a_plan_error():
    with pytest.raises(PlanError):
        plan_chain(record(ref(11, 10), ref(12, 11)), None)  # keyframe dropped from the record
    with pytest.raises(PlanError):
        plan_chain(record(ref(10, None), ref(12, 11)), ("s1", 10))  # a hole in the deltas
