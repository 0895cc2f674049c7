"""An async inference peer does not keep sampling with a version the trainers refuse as too stale."""

from __future__ import annotations

import threading
import time

from echo_p2p.config import InferenceSection
from echo_p2p.roles.inference import InferencePeer
from tests.unit.conftest import unstarted_peer


class FakeFetcher:
    def __init__(self):
        self.nudges = 0

    def nudge(self):
        self.nudges += 1


def peer(
    version: int | None, floor: int | None, stale_wait: float = 5.0, useful: int | None = None
) -> InferencePeer:
    p = unstarted_peer(InferencePeer, inference=InferenceSection(stale_wait=stale_wait))
    p.pusher = type("P", (), {"stale_floor": floor, "useful_floor": lambda self: useful})()
    p.fetcher = FakeFetcher()
    p.policy_version = version
    return p


def test_no_wait_while_the_version_is_accepted():
    p = peer(version=7, floor=6)
    p._wait_if_stale()
    assert p.stale_waits == 0 and p.fetcher.nudges == 0
    p = peer(version=7, floor=None)
    p._wait_if_stale()
    assert p.stale_waits == 0


def test_a_refused_version_waits_for_a_newer_one_and_asks_for_it():
    p = peer(version=6, floor=6)

    def newer_version_arrives():
        time.sleep(0.3)
        with p._new_version:
            p.policy_version = 8
            p._new_version.notify_all()

    threading.Thread(target=newer_version_arrives).start()
    t0 = time.monotonic()
    p._wait_if_stale()
    assert 0.2 < time.monotonic() - t0 < 3.0
    assert p.policy_version == 8 and p.fetcher.nudges == 1 and p.stale_waits == 1
    assert p.weights_wait_seconds > 0.2


def test_the_wait_has_a_deadline():
    p = peer(version=6, floor=6, stale_wait=0.3)
    t0 = time.monotonic()
    p._wait_if_stale()  # no newer version comes: sample anyway after stale_wait
    assert 0.25 < time.monotonic() - t0 < 2.0 and p.policy_version == 6


def test_on_trainer_version_nudges_only_for_a_newer_version():
    p = peer(version=5, floor=None)
    p._on_trainer_version(5)
    assert p.fetcher.nudges == 0
    p._on_trainer_version(6)
    assert p.fetcher.nudges == 1


def test_a_version_the_trainer_would_refuse_on_arrival_waits_before_any_refusal():
    from echo_p2p.transport.rollouts.grants import TrainerState
    from echo_p2p.transport.rollouts.push import RolloutPusher

    pusher = RolloutPusher(loop=None, directory=None)
    assert pusher.useful_floor() is None  # nothing known yet: no wait
    pusher._ledger.trainers = {"t": TrainerState("t", [], room=1, stamp=0.0, max_staleness=4)}
    pusher.trainer_version = 10  # its last ack: a group of version 7 lands at 11, 4 old, the bound
    assert pusher.useful_floor() == 7
    p = peer(version=7, floor=None, useful=pusher.useful_floor(), stale_wait=0.3)
    p._wait_if_stale()
    assert p.stale_waits == 1 and p.fetcher.nudges == 1  # asked for a newer version instead of sampling
    p = peer(version=8, floor=None, useful=pusher.useful_floor())
    p._wait_if_stale()
    assert p.stale_waits == 0


def test_the_announced_waiting_share_follows_the_time_spent_waiting_for_grants(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("echo_p2p.roles.inference.time.monotonic", lambda: clock[0])
    p = peer(version=7, floor=None)
    p.pusher.seconds_paced = 0.0
    p.waiting_for_grants, p._paced_mark = None, None
    assert p._waiting_share() is None  # the first look only marks
    clock[0] += 2.0
    p.pusher.seconds_paced = 1.5  # waited 1.5 s of 2
    assert p._waiting_share() == 0.75
    clock[0] += 0.5
    assert p._waiting_share() == 0.75  # less than a second later: unchanged
    clock[0] += 1.5
    p.pusher.seconds_paced = 1.5  # sampled the whole time since
    assert p._waiting_share() == 0.375  # smoothed: half the old share, half the new
