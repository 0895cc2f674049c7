"""The status of one run, built from one read of its directory: what ``swarm status --json`` prints and what
the monitor serves at ``/api/status``.

Owned here: ``read_snapshot`` (the DHT reads: run record, peers, policy records, bans; every read has the
directory's deadline, and a read that fails or times out is reported, not raised), ``build_status`` (a
snapshot -> a JSON-ready dict: run header, summary, one row per peer, publishers, bans, DHT health and the
alerts of ``alerts.evaluate``) and ``peer_rows``. Everything in a snapshot came from peers: strings are cut
to bounds, numbers that are not finite become None, lists are capped, so the dict is small and always valid
JSON (``json.dumps(..., allow_nan=False)`` holds). Callers: ``echo_p2p.swarm``, ``monitor.poller``,
``echo_p2p.local``. Imports no hivemind and no torch at module level.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from echo_p2p import __version__
from echo_p2p.monitor.alerts import evaluate
from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.sampling import BucketSampler

#: Caps on what one status carries (the records' own limits are looser or absent).
MAX_TEXT = 128
MAX_MADDR_CHARS = 256
MAX_PUBLISHERS = 64
MAX_BANS = 256


@dataclass
class Snapshot:
    """One read of a run's directory. ``trust`` is a ``guard.trust.RunTrust`` (or None: no opinion)."""

    run_id: str
    time: float
    peers: list = field(default_factory=list)  # Entry[PeerRecord]
    policies: list = field(default_factory=list)  # Entry[PolicyRecord]
    bans: list = field(default_factory=list)  # Entry[BanRecord]
    rejected: dict[str, int] = field(default_factory=dict)
    trust: Any = None
    dht_error: str | None = None
    connections: int | None = None  # libp2p connections of the reading node (None: not asked)
    buckets: dict[str, int] = field(default_factory=dict)  # directory coverage (``sampling.Sample``)


def read_snapshot(
    directory,
    run_id: str,
    trust=None,
    connections: Callable[[], int] | None = None,
    sampler: BucketSampler | None = None,
) -> Snapshot:
    """Read the run's records once through ``directory`` (a ``SwarmDirectory``): the trainers and, through
    ``sampler`` (one kept across polls; a fresh one when None), some of the inference peers' buckets.
    Never raises on DHT trouble."""
    snap = Snapshot(run_id=run_id, time=time.time(), trust=trust)
    timeouts = directory.read_timeouts
    sampler = sampler or BucketSampler()
    try:
        if trust is not None and trust.owner is not None:
            trust.update(entry.record for entry in directory.run_records())
        directory.use_run_record(trust)
        sample = sampler.poll(directory)
        snap.peers = sorted(directory.trainers() + sample.entries, key=lambda e: -e.record.updated_at)
        snap.buckets = {
            "total": sample.buckets,
            "read_now": sample.read_now,
            "known": sample.known,
            "unseen_peers": sample.unseen,
        }
        snap.policies = directory.policies()
        snap.bans = directory.ban_records()
        if connections is not None:
            snap.connections = int(connections())
    except Exception as exc:  # the DHT process died, a pipe broke: a status that says so
        snap.dht_error = f"reading the DHT failed ({type(exc).__name__})"
    missed = directory.read_timeouts - timeouts
    if snap.dht_error is None and missed:
        snap.dht_error = f"{missed} DHT read(s) got no answer within {directory.request_timeout:g} s"
    if snap.dht_error is None and snap.connections == 0:
        snap.dht_error = "connected to no DHT peer"
    snap.rejected = dict(directory.rejected)
    snap.time = time.time()
    return snap


def num(value: Any, digits: int | None = None) -> float | int | None:
    """A finite number (rounded to ``digits``), else None: peers' figures never put NaN/inf into JSON."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return round(value, digits) if digits is not None and isinstance(value, float) else value


def text(value: Any, limit: int = MAX_TEXT) -> str | None:
    return None if value is None else str(value)[:limit]


def reachability(maddrs: Iterable[str]) -> str:
    """What a peer's announced addresses say: ``direct`` (a dialable address), ``relayed`` (only through a
    relay), ``unreachable`` (none). Announced, not verified by the reader."""
    maddrs = list(maddrs)
    if not maddrs:
        return "unreachable"
    return "direct" if any("/p2p-circuit" not in m for m in maddrs) else "relayed"


def _trusted(trust, role: str, peer_id: str) -> bool | None:
    """True/False for trainers when the reader knows the run's trainers, else None (no opinion)."""
    if trust is None or not trust.configured or role != "trainer":
        return None
    return bool(trust.is_trusted(peer_id))


def peer_rows(entries, now: float, trust=None, newest: int | None = None) -> list[dict[str, Any]]:
    """One row per peer (trainers first, then by peer id); ``lag`` is versions behind ``newest`` (now)."""
    rows = []
    for entry in entries:
        r = entry.record
        version = num(r.policy_version)
        maddrs = [m[:MAX_MADDR_CHARS] for m in r.maddrs[:16]]
        rows.append(
            {
                "peer_id": text(r.peer_id),
                "role": r.role,
                "state": r.state,
                "stalled": [text(s, 32) for s in r.stalled[:8]] if r.stalled else None,
                "mode": r.mode,
                "policy_version": version,
                "lag": max(0, newest - version) if newest is not None and version is not None else None,
                "software_version": text(r.software_version, 64),
                "tokens_per_second": num(r.tokens_per_second, 1),
                "rollouts_per_second": num(r.rollouts_per_second, 3),
                "free_buffer_room": num(r.free_buffer_room),
                "buffered_groups": num(r.buffered_groups),
                "accepts_rollouts": r.accepts_rollouts,
                "rollouts_consumed": num(r.rollouts_consumed),
                "reward_mean": num(r.reward_mean, 4),
                "max_staleness": num(r.max_staleness),
                "chunks_served": num(r.chunks_served),
                "eval_version": num(r.eval_version),
                "eval_accuracy": num(r.eval_accuracy, 4),
                "eval_reward": num(r.eval_reward, 4),
                "waiting_for_grants": num(r.waiting_for_grants, 3),
                "last_seen_s": num(round(max(0.0, now - r.updated_at), 1)),
                "uptime_s": num(round(max(0.0, now - r.started_at), 1)),
                "expires_in_s": num(round(entry.expires_at - now, 1)),
                "maddrs": maddrs,
                "reachability": reachability(maddrs),
                "trusted": _trusted(trust, r.role, r.peer_id),
            }
        )
    rows.sort(key=lambda row: (row["role"] != "trainer", row["role"], row["peer_id"] or ""))
    return rows


def _is_trainer_of_run(row: dict[str, Any]) -> bool:
    return row["role"] == "trainer" and row["trusted"] is not False


def build_status(snap: Snapshot, config: MonitorConfig | None = None, tracker=None) -> dict[str, Any]:
    """The status dict of ``snap``; with a ``history.Tracker`` the time-based alerts and rates are filled."""
    config = config or MonitorConfig()
    now, trust = snap.time, snap.trust
    publishers = [
        {
            "peer_id": text(e.record.peer_id),
            "version": num(e.record.version),
            "trusted": None
            if trust is None or not trust.configured
            else bool(trust.is_trusted(e.record.peer_id)),
            "updated_s_ago": num(round(max(0.0, now - e.record.updated_at), 1)),
        }
        for e in snap.policies[:MAX_PUBLISHERS]
    ]
    rows = peer_rows(snap.peers, now, trust)
    running = [r for r in rows if r["state"] == "running"]
    trainers = [r for r in running if _is_trainer_of_run(r)]
    versions = [r["policy_version"] for r in trainers if r["policy_version"] is not None]
    versions += [p["version"] for p in publishers if p["trusted"] is not False and p["version"] is not None]
    newest = max(versions, default=None)
    for row in rows:
        if newest is not None and row["policy_version"] is not None:
            row["lag"] = max(0, newest - row["policy_version"])
    bounds = [r["max_staleness"] for r in trainers if r["max_staleness"] is not None]
    rewards = [r["reward_mean"] for r in trainers if r["reward_mean"] is not None]
    # the held-out figures of the newest evaluated version (the publisher's; a former publisher's are older)
    evaluated = max(
        (r for r in trainers if r["eval_version"] is not None), key=lambda r: r["eval_version"], default=None
    )
    status: dict[str, Any] = {
        "run_id": snap.run_id,
        "time": now,
        "monitor_version": __version__,
        "trust": trust.describe() if trust is not None else "no trusted trainers configured",
        "trust_configured": bool(trust is not None and trust.configured),
        "run": _run_header(trust, running),
        "summary": {
            "newest_version": newest,
            "trainers": len(trainers),
            "inference": sum(1 for r in running if r["role"] == "inference"),
            "impostors": sum(1 for r in rows if r["trusted"] is False),
            "peers_total": len(rows),
            # inference peers in directory buckets not read yet (estimated from the buckets read)
            "peers_unseen": snap.buckets.get("unseen_peers", 0),
            "peers_listed": min(len(rows), config.max_peers),
            "reward": num(round(sum(rewards) / len(rewards), 4)) if rewards else None,
            "eval_version": evaluated["eval_version"] if evaluated else None,
            "eval_accuracy": evaluated["eval_accuracy"] if evaluated else None,
            "eval_reward": evaluated["eval_reward"] if evaluated else None,
            "rollouts_consumed": sum(r["rollouts_consumed"] or 0 for r in trainers) if trainers else None,
            "rollouts_per_second": num(round(sum(r["rollouts_per_second"] or 0.0 for r in trainers), 3)),
            "tokens_per_second": num(
                round(sum(r["tokens_per_second"] or 0.0 for r in running if r["role"] == "inference"), 1)
            ),
            "max_staleness": max(bounds) if bounds else config.default_max_staleness,
            "versions_per_minute": None,
        },
        "peers": rows[: config.max_peers],
        "publishers": publishers,
        "bans": _bans(snap, rows),
        "rejected": {text(k, 64): num(v) for k, v in list(snap.rejected.items())[:32]},
        "dht": {"ok": snap.dht_error is None, "error": snap.dht_error, "connections": snap.connections},
        "directory": {text(k, 32): num(v) for k, v in snap.buckets.items()},
    }
    timers = None
    if tracker is not None:
        timers = tracker.observe(status)
        status["summary"]["versions_per_minute"] = tracker.versions_per_minute()
        _align_lags(status["peers"], now, tracker)
    status["alerts"] = evaluate(status, config, timers)
    return status


def _align_lags(rows: list[dict[str, Any]], now: float, tracker) -> None:
    """Lag behind the newest version *when the peer announced itself*: a record is up to a heartbeat old,
    and a fast run moves several versions in a heartbeat. ``tracker.newest_at`` gives the newest version the
    monitor had seen by then (a lower bound: the lag is never overstated); None when it was not watching yet."""
    for row in rows:
        if row["policy_version"] is None or row["last_seen_s"] is None:
            continue
        newest = tracker.newest_at(now - row["last_seen_s"])
        row["lag"] = None if newest is None else max(0, newest - row["policy_version"])


def _run_header(trust, running: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run trains: from the owner's signed record when there is one, else the peers' own modes."""
    record = getattr(trust, "record", None) if trust is not None else None
    modes = Counter(r["mode"] for r in running if r["mode"])
    header: dict[str, Any] = {
        "model": None,
        "task": None,
        "mode": modes.most_common(1)[0][0] if modes else None,
        "owner": text(getattr(trust, "owner", None)),
        "serial": None,
        "trainers_declared": None,
        "note": None,
    }
    if record is not None:
        header.update(
            model=text(record.model),
            task=text(record.task),
            mode=record.mode or header["mode"],
            serial=num(record.serial),
            trainers_declared=len(record.trainers),
            note=text(record.note, 256),
        )
    return header


def _bans(snap: Snapshot, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bans in force by the run's trainers (every trainer's when the reader knows no trainers)."""
    trust, now = snap.trust, snap.time
    present = {r["peer_id"] for r in rows}
    out = []
    for entry in snap.bans:
        by = entry.record.peer_id
        if trust is not None and trust.configured and not trust.is_trusted(by):
            continue
        for ban in entry.record.bans:
            until = num(ban.until)
            if until is None or until <= now:
                continue
            out.append(
                {
                    "peer_id": text(ban.peer_id),
                    "by": text(by),
                    "reason": text(ban.reason, 32),
                    "until_in_s": num(round(until - now, 1)),
                    "present": ban.peer_id in present,
                }
            )
            if len(out) >= MAX_BANS:
                return out
    return out
