"""The status built from one directory read: trust, versions and lag, bounds on peer input, the run header."""

from __future__ import annotations

import json
import time

from echo_p2p.guard.trust import RunTrust
from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.history import Tracker
from echo_p2p.monitor.status import Snapshot, build_status, reachability, read_snapshot
from echo_p2p.net.records import PeerRecord
from echo_p2p.net.run_record import RunRecord
from tests.unit.monitor.fakes import (
    IMPOSTOR,
    INF_A,
    INF_B,
    TRAINER,
    FakeDirectory,
    bans,
    entry,
    peer,
    policy,
    trainer,
    trust,
)


def snap(**kw) -> Snapshot:
    return Snapshot(run_id="r", time=time.time(), **kw)


def by_id(status: dict) -> dict[str, dict]:
    return {row["peer_id"]: row for row in status["peers"]}


def test_newest_version_and_lag_come_from_the_runs_trainers_not_from_impostors():
    s = build_status(
        snap(
            peers=[
                trainer(policy_version=12),
                trainer(IMPOSTOR, policy_version=500, reward_mean=-3.0),
                peer(INF_A, policy_version=12),
                peer(INF_B, policy_version=3),
            ],
            policies=[policy(TRAINER, 12), policy(IMPOSTOR, 900)],
            trust=trust(TRAINER),
        )
    )
    rows = by_id(s)
    assert s["summary"]["newest_version"] == 12
    assert rows[INF_B]["lag"] == 9 and rows[INF_A]["lag"] == 0
    assert rows[TRAINER]["trusted"] is True and rows[IMPOSTOR]["trusted"] is False
    assert rows[INF_A]["trusted"] is None  # inference peers are not judged
    assert s["summary"]["trainers"] == 1 and s["summary"]["impostors"] == 1
    assert s["summary"]["reward"] == 0.5  # the impostor's claimed reward is not the run's
    assert [p["trusted"] for p in s["publishers"]] == [True, False]
    assert [p["code"] for p in s["alerts"]] == ["peer_lagging", "untrusted_manifests", "impostor"]
    assert s["peers"][0]["role"] == "trainer"  # trainers listed first


def test_without_trust_every_trainer_counts_and_nobody_is_called_an_impostor():
    s = build_status(snap(peers=[trainer(policy_version=3), trainer(IMPOSTOR, policy_version=4)]))
    assert s["summary"]["trainers"] == 2 and s["summary"]["newest_version"] == 4
    assert {row["trusted"] for row in s["peers"]} == {None}
    assert s["trust_configured"] is False and s["alerts"] == []


def test_peer_strings_are_cut_numbers_made_finite_and_the_result_is_strict_json():
    hostile = "<img src=x onerror=alert(1)>"
    s = build_status(
        snap(
            peers=[
                # longer than a record may carry (``MAX_STR``): the status cuts it whatever the record says
                entry(
                    trainer(software_version=hostile).record.model_copy(
                        update={"maddrs": ["/ip4/1.2.3.4/tcp/1/" + "a" * 5000]}
                    )
                ),
                # records refuse inf/NaN (``allow_inf_nan=False``); the status does not rely on it
                entry(
                    PeerRecord.model_construct(
                        peer_id=INF_A,
                        role="inference",
                        mode="async",
                        maddrs=[],
                        tokens_per_second=float("inf"),
                        updated_at=float("-inf"),
                        started_at=float("nan"),
                    )
                ),
            ],
            trust=trust(TRAINER),
        )
    )
    rows = by_id(s)
    assert rows[TRAINER]["software_version"] == hostile  # kept as data; the page renders it as text
    assert len(rows[TRAINER]["maddrs"][0]) == 256
    assert rows[INF_A]["tokens_per_second"] is None
    assert rows[INF_A]["last_seen_s"] is None and rows[INF_A]["uptime_s"] == 0.0
    json.dumps(s, allow_nan=False)  # raises on NaN/inf anywhere


def test_the_peer_list_is_capped_but_counted():
    peers = [peer(f"Qm{i:044d}") for i in range(30)]
    s = build_status(snap(peers=[trainer(), *peers]), MonitorConfig(max_peers=10))
    assert len(s["peers"]) == 10 and s["summary"]["peers_total"] == 31
    assert s["peers"][0]["peer_id"] == TRAINER


def test_bans_in_force_by_trusted_trainers_only():
    s = build_status(
        snap(
            peers=[trainer(), peer(INF_A)],
            bans=[
                bans(TRAINER, INF_A, reason="logprob_gap"),
                bans(TRAINER, INF_B, until=time.time() - 1),  # over
                bans(IMPOSTOR, TRAINER, reason="spite"),  # not the run's trainer
            ],
            trust=trust(TRAINER),
        )
    )
    assert [(b["peer_id"], b["by"], b["present"]) for b in s["bans"]] == [(INF_A, TRAINER, True)]
    assert [a["code"] for a in s["alerts"]] == ["banned_peers"]


def test_reachability_is_read_from_the_announced_addresses():
    assert reachability([]) == "unreachable"
    assert reachability(["/ip4/1.2.3.4/tcp/5/p2p/QmRelay/p2p-circuit/p2p/QmMe"]) == "relayed"
    assert reachability(["/ip4/1.2.3.4/tcp/5/p2p/QmMe", "/ip4/1.2.3.4/tcp/5/p2p/QmR/p2p-circuit"]) == "direct"


def test_run_header_comes_from_the_owners_record():
    record = RunRecord(
        run_id="r",
        owner_key="ssh-rsa AAAA",
        trainers=[TRAINER],
        serial=7,
        issued_at=0.0,
        expires_at=time.time() + 100,
        model="tiny",
        task="count",
        mode="sync",
    )
    owner_trust = RunTrust(owner="QmOwner", run_id="r")
    owner_trust.record = record
    s = build_status(snap(peers=[trainer(), peer(INF_A)], trust=owner_trust))
    assert {k: s["run"][k] for k in ("model", "task", "mode", "serial", "trainers_declared")} == {
        "model": "tiny",
        "task": "count",
        "mode": "sync",
        "serial": 7,
        "trainers_declared": 1,
    }
    # no record: the mode the peers run in
    assert build_status(snap(peers=[trainer()]))["run"]["mode"] == "async"


def test_read_snapshot_reports_dht_trouble_instead_of_raising():
    ok = read_snapshot(FakeDirectory(), "r", connections=lambda: 2)
    assert ok.dht_error is None and len(ok.peers) == 1 and ok.rejected == {"malformed": 2}
    assert "no answer within 5 s" in read_snapshot(FakeDirectory(timeouts=1), "r").dht_error
    assert "BrokenPipeError" in read_snapshot(FakeDirectory(fail=True), "r").dht_error
    lonely = read_snapshot(FakeDirectory(), "r", connections=lambda: 0)
    assert lonely.dht_error == "connected to no DHT peer"
    assert [a["code"] for a in build_status(lonely)["alerts"]] == ["dht_unreachable"]


def test_a_tracker_fills_versions_per_minute_and_the_timed_alerts():
    config = MonitorConfig(stall_after=30.0, buffer_empty_after=20.0)
    tracker = Tracker(config)
    t0 = time.time()
    for i in range(7):  # a version every 10 s, then none for 40 s
        s = build_status(
            Snapshot("r", t0 + 10 * i, peers=[trainer(policy_version=min(i, 3))]), config, tracker
        )
    assert s["summary"]["versions_per_minute"] == 3 * 60 / 60
    assert [a["code"] for a in s["alerts"]] == ["version_stalled"]
    assert "30 s" in s["alerts"][0]["message"]


def test_with_a_tracker_lag_is_measured_against_the_newest_version_when_the_peer_announced():
    """A fast run moves several versions within one heartbeat: a peer that announced version 10 two seconds
    ago, when 11 was the newest, lags 1, not the 15 that comparing with now (25) would say."""
    tracker = Tracker(MonitorConfig(default_max_staleness=4))
    t0 = time.time()
    for i, version in enumerate((5, 11, 18)):
        build_status(Snapshot("r", t0 + 2 * i, peers=[trainer(policy_version=version)]), tracker=tracker)
    now = t0 + 6
    s = build_status(
        Snapshot(
            "r",
            now,
            peers=[
                trainer(policy_version=25, updated_at=now),
                peer(INF_A, policy_version=10, updated_at=now - 3.5),  # when 11 was the newest
                peer(INF_B, policy_version=3, updated_at=now - 3.5),  # 8 behind even then
                peer(IMPOSTOR, policy_version=1, updated_at=t0 - 100),  # before the monitor watched
            ],
        ),
        tracker=tracker,
    )
    rows = by_id(s)
    assert (rows[INF_A]["lag"], rows[INF_B]["lag"], rows[IMPOSTOR]["lag"], rows[TRAINER]["lag"]) == (
        1,
        8,
        None,
        0,
    )
    assert [(a["code"], a["peers"]) for a in s["alerts"]] == [("peer_lagging", [INF_B])]


def test_the_held_out_figures_are_those_of_the_newest_evaluated_version_of_a_trainer_of_the_run():
    other = "QmZ4tDuvesekSs4qM5ZBKpXiZGun7S2CYtEZRB3DYXkjGx"
    s = build_status(
        snap(
            peers=[
                trainer(policy_version=12, eval_version=10, eval_accuracy=0.5, eval_reward=0.45),
                trainer(other, policy_version=12, eval_version=4, eval_accuracy=0.1, eval_reward=0.2),
                trainer(IMPOSTOR, policy_version=99, eval_version=99, eval_accuracy=1.0, eval_reward=1.0),
            ],
            trust=trust(TRAINER, other),
        )
    )
    summary = s["summary"]
    assert (summary["eval_version"], summary["eval_accuracy"], summary["eval_reward"]) == (10, 0.5, 0.45)
    assert by_id(s)[other]["eval_accuracy"] == 0.1
    assert build_status(snap(peers=[trainer()]))["summary"]["eval_accuracy"] is None
