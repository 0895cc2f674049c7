"""Fake inputs for the monitor's unit tests: directory entries of real (validated) records, and status dicts."""

from __future__ import annotations

import time
from typing import Any

from echo_p2p.guard.trust import RunTrust, TrustedTrainers
from echo_p2p.net.directory import Entry
from echo_p2p.net.records import Ban, BanRecord, PeerRecord, PolicyRecord

# base58 peer ids (the trust file parser checks the multihash shape)
TRAINER = "QmQAbD1EUxToUawWUKjh1doo9iC83FjbPVdhye9gwMeo2v"
IMPOSTOR = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
INF_A = "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"
INF_B = "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM"


def entry(record, ttl: float = 30.0) -> Entry:
    return Entry(record, time.time() + ttl)


def peer(peer_id: str, role: str = "inference", **fields: Any) -> Entry:
    return entry(PeerRecord(peer_id=peer_id, role=role, mode="async", **fields))


def trainer(peer_id: str = TRAINER, **fields: Any) -> Entry:
    defaults = dict(
        policy_version=10,
        accepts_rollouts=True,
        buffered_groups=5,
        max_staleness=4,
        rollouts_consumed=100,
        reward_mean=0.5,
    )
    return peer(peer_id, "trainer", **{**defaults, **fields})


def policy(peer_id: str, version: int) -> Entry:
    return entry(PolicyRecord(peer_id=peer_id, stream_id="s", version=version))


def bans(by: str, *banned: str, reason: str = "logprob_gap", until: float | None = None) -> Entry:
    until = time.time() + 300 if until is None else until
    return entry(BanRecord(peer_id=by, bans=[Ban(peer_id=p, until=until, reason=reason) for p in banned]))


def trust(*trainers: str) -> RunTrust:
    return RunTrust(fixed=TrustedTrainers(frozenset(trainers), "test"))


def row(peer_id: str, role: str = "inference", **fields: Any) -> dict[str, Any]:
    """A peer row as ``status.peer_rows`` makes it (the fields the alerts read)."""
    base = {
        "peer_id": peer_id,
        "role": role,
        "state": "running",
        "policy_version": 10,
        "lag": 0,
        "trusted": True if role == "trainer" else None,
        "accepts_rollouts": True if role == "trainer" else None,
        "buffered_groups": 5 if role == "trainer" else None,
        "rollouts_consumed": 100 if role == "trainer" else None,
    }
    return {**base, **fields}


def status(peers: list[dict] | None = None, **overrides: Any) -> dict[str, Any]:
    """A healthy status (one trusted trainer, two inference peers at the newest version) with overrides;
    ``summary`` overrides are merged."""
    peers = peers if peers is not None else [row(TRAINER, "trainer"), row(INF_A), row(INF_B)]
    summary = {
        "newest_version": 10,
        "trainers": sum(
            1
            for p in peers
            if p["role"] == "trainer" and p["trusted"] is not False and p["state"] == "running"
        ),
        "inference": sum(1 for p in peers if p["role"] == "inference" and p["state"] == "running"),
        "impostors": sum(1 for p in peers if p["trusted"] is False),
        "reward": 0.5,
        "rollouts_consumed": 100,
        "rollouts_per_second": 1.0,
        "max_staleness": 4,
    }
    summary.update(overrides.pop("summary", {}))
    out = {
        "time": time.time(),
        "summary": summary,
        "peers": peers,
        "publishers": [{"peer_id": TRAINER, "version": 10, "trusted": True}],
        "bans": [],
        "dht": {"ok": True, "error": None, "connections": 3},
    }
    out.update(overrides)
    return out


class FakeDirectory:
    """A ``SwarmDirectory`` for ``read_snapshot``: one trainer, no other record; it can fail or time out."""

    def __init__(self, fail: bool = False, timeouts: int = 0):
        self.fail, self.timeouts_per_read = fail, timeouts
        self.read_timeouts = 0
        self.request_timeout = 5.0
        self.rejected = {"malformed": 2}
        self.buckets = 1

    def use_run_record(self, trust):
        pass

    def trainers(self):
        if self.fail:
            raise BrokenPipeError("the DHT process is gone")
        self.read_timeouts += self.timeouts_per_read
        return [trainer()]

    def peers(self, buckets):
        return []

    def policies(self):
        return []

    def ban_records(self):
        return []

    def run_records(self):
        return []
