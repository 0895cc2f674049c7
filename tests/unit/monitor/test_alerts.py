"""Each alert of the monitor fires on the fake status that shows its problem, and stays silent on a healthy one."""

from __future__ import annotations

import pytest

from echo_p2p.monitor.alerts import ALERTS, Timers, evaluate
from echo_p2p.monitor.config import MonitorConfig
from tests.unit.monitor.fakes import IMPOSTOR, INF_A, INF_B, TRAINER, row, status

CONFIG = MonitorConfig(stall_after=60.0, buffer_empty_after=30.0)
NOW = 1_000_000.0


def codes(alerts: list[dict]) -> list[str]:
    return [a["code"] for a in alerts]


def timers(**kw) -> Timers:
    return Timers(now=NOW, **{"watching_since": NOW - 600, "version_since": NOW - 5, **kw})


def test_a_healthy_run_raises_no_alert_with_or_without_timers():
    assert evaluate(status(), CONFIG) == []
    assert evaluate(status(), CONFIG, timers()) == []


def test_dht_unreachable_fires_when_reads_fail_and_hides_no_trainer():
    s = status(
        peers=[], dht={"ok": False, "error": "2 DHT read(s) got no answer within 5 s", "connections": 0}
    )
    alerts = evaluate(s, CONFIG)
    assert codes(alerts) == ["dht_unreachable"]  # an empty read says nothing about trainers
    assert alerts[0]["severity"] == "critical" and "no answer" in alerts[0]["message"]


def test_no_trainer_fires_when_no_trainer_of_the_run_runs():
    s = status(peers=[row(INF_A), row(TRAINER, "trainer", state="leaving")])
    alerts = evaluate(s, CONFIG)
    assert codes(alerts) == ["no_trainer"] and alerts[0]["severity"] == "critical"
    s = status(peers=[row(INF_A), row(IMPOSTOR, "trainer", trusted=False)])
    alerts = evaluate(s, CONFIG)
    assert codes(alerts) == ["no_trainer", "impostor"]
    assert "1 peer(s) not in the run record" in alerts[0]["message"]


def test_version_stalled_fires_after_stall_after_seconds_without_a_new_version():
    s = status()
    assert evaluate(s, CONFIG, timers(version_since=NOW - 59)) == []
    alerts = evaluate(s, CONFIG, timers(version_since=NOW - 61))
    assert codes(alerts) == ["version_stalled"]
    assert "61 s" in alerts[0]["message"] and "newest: 10" in alerts[0]["message"]
    # a monitor that just started cannot tell
    assert evaluate(s, CONFIG, timers(watching_since=NOW - 10, version_since=NOW - 10)) == []
    # no version ever, trainers running for long enough
    s = status(summary={"newest_version": None})
    assert codes(evaluate(s, CONFIG, timers(version_since=None))) == ["version_stalled"]
    # without timers (a one-shot swarm status) it stays silent
    assert evaluate(s, CONFIG) == []


def test_peer_lagging_fires_for_inference_peers_past_the_staleness_bound_only():
    peers = [row(TRAINER, "trainer"), row(INF_A, lag=4), row(INF_B, lag=5, policy_version=5)]
    alerts = evaluate(status(peers=peers), CONFIG)
    assert codes(alerts) == ["peer_lagging"]
    assert alerts[0]["peers"] == [INF_B]
    assert "more than 4 versions behind" in alerts[0]["message"]
    # the bound the trainers announce is the one applied
    assert evaluate(status(peers=peers, summary={"max_staleness": 8}), CONFIG) == []
    # a leaving peer is not counted
    peers[2]["state"] = "leaving"
    assert evaluate(status(peers=peers), CONFIG) == []


def test_samplers_waiting_fires_when_most_inference_peers_mostly_wait_for_grants():
    peers = [row(TRAINER, "trainer"), row(INF_A, waiting_for_grants=0.7), row(INF_B, waiting_for_grants=0.2)]
    assert evaluate(status(peers=peers), CONFIG) == []  # one of two: not most
    peers[2]["waiting_for_grants"] = 0.6
    alerts = evaluate(status(peers=peers), CONFIG)
    assert codes(alerts) == ["samplers_waiting"] and alerts[0]["severity"] == "info"
    assert sorted(alerts[0]["peers"]) == sorted([INF_A, INF_B])
    assert "65% on average" in alerts[0]["message"] and "no more samplers" in alerts[0]["message"]
    peers[1]["waiting_for_grants"] = peers[2]["waiting_for_grants"] = None  # sync peers, or not yet measured
    assert evaluate(status(peers=peers), CONFIG) == []


def test_untrusted_manifests_fires_for_policy_records_of_keys_the_run_does_not_trust():
    pubs = [
        {"peer_id": TRAINER, "version": 10, "trusted": True},
        {"peer_id": IMPOSTOR, "version": 99, "trusted": False},
    ]
    alerts = evaluate(status(publishers=pubs), CONFIG)
    assert codes(alerts) == ["untrusted_manifests"]
    assert alerts[0]["peers"] == [IMPOSTOR]
    # a reader that knows no trainers has no opinion (trusted None): no alert
    pubs[1]["trusted"] = None
    assert evaluate(status(publishers=pubs), CONFIG) == []


def test_impostor_fires_for_trainers_outside_the_run_record():
    peers = [row(TRAINER, "trainer"), row(IMPOSTOR, "trainer", trusted=False), row(INF_A)]
    alerts = evaluate(status(peers=peers), CONFIG)
    assert codes(alerts) == ["impostor"]
    assert alerts[0]["peers"] == [IMPOSTOR] and alerts[0]["severity"] == "warning"


def test_banned_peers_lists_each_banned_peer_once_with_the_reasons():
    ban = {"by": TRAINER, "until_in_s": 100.0, "present": True}
    bans = [
        {"peer_id": INF_A, "reason": "logprob_gap", **ban},
        {"peer_id": INF_A, "reason": "logprob_gap", **ban},
        {"peer_id": INF_B, "reason": "forged_reward", **ban},
    ]
    alerts = evaluate(status(bans=bans), CONFIG)
    assert codes(alerts) == ["banned_peers"]
    assert alerts[0]["peers"] == [INF_A, INF_B]
    assert "2 peer(s)" in alerts[0]["message"] and "forged_reward, logprob_gap" in alerts[0]["message"]


def test_buffer_empty_fires_once_a_trainer_starved_for_buffer_empty_after_seconds():
    assert evaluate(status(), CONFIG, timers(starved_since={TRAINER: NOW - 29})) == []
    alerts = evaluate(status(), CONFIG, timers(starved_since={TRAINER: NOW - 31}))
    assert codes(alerts) == ["buffer_empty"] and alerts[0]["peers"] == [TRAINER]


def test_alerts_are_sorted_by_severity_and_carry_bounded_peer_lists():
    many = [row(f"Qm{i:044d}", lag=50) for i in range(40)]
    s = status(
        peers=[row(TRAINER, "trainer"), *many],
        dht={"ok": False, "error": "x", "connections": 0},
        bans=[{"peer_id": INF_A, "reason": "", "by": TRAINER, "until_in_s": 1.0, "present": False}],
    )
    alerts = evaluate(s, CONFIG)
    assert codes(alerts) == ["dht_unreachable", "peer_lagging", "banned_peers"]
    assert len(alerts[1]["peers"]) == 20  # MAX_ALERT_PEERS
    assert all(a["severity"] == ALERTS[a["code"]][0] for a in alerts)


@pytest.mark.parametrize("code", sorted(ALERTS))
def test_every_alert_code_is_documented_in_the_readme(code):
    from tests.conftest import REPO

    assert f"`{code}`" in (REPO / "README.md").read_text()
