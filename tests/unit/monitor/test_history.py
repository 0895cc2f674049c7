"""The monitor's memory: bounded samples, the version clock, the starved-trainer clock."""

from __future__ import annotations

from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.history import Tracker
from tests.unit.monitor.fakes import TRAINER, row, status

T0 = 1_000_000.0


def at(t: float, version: int | None = 10, **trainer_fields) -> dict:
    s = status(peers=[row(TRAINER, "trainer", **trainer_fields)], summary={"newest_version": version})
    s["time"] = t
    return s


def test_samples_are_bounded_and_served_after_a_time():
    tracker = Tracker(MonitorConfig(history_size=10))
    for i in range(25):
        tracker.observe(at(T0 + i, version=i))
    assert len(tracker.samples) == 10
    assert [s["version"] for s in tracker.since(T0 + 20, limit=100)] == [21, 22, 23, 24]
    assert [s["version"] for s in tracker.since(0, limit=2)] == [23, 24]


def test_the_version_clock_restarts_only_when_the_newest_version_grows():
    tracker = Tracker()
    assert tracker.observe(at(T0, version=None)).version_since is None
    assert tracker.observe(at(T0 + 1, version=5)).version_since == T0 + 1
    assert tracker.observe(at(T0 + 2, version=5)).version_since == T0 + 1
    assert tracker.observe(at(T0 + 3, version=4)).version_since == T0 + 1  # a lagging read: not new
    assert tracker.observe(at(T0 + 4, version=6)).version_since == T0 + 4
    assert tracker.watching_since == T0


def test_a_trainer_is_starved_while_its_buffer_is_empty_and_it_consumes_nothing():
    tracker = Tracker()
    assert tracker.observe(at(T0, buffered_groups=3)).starved_since == {}
    assert tracker.observe(at(T0 + 1, buffered_groups=0, rollouts_consumed=50)).starved_since == {
        TRAINER: T0 + 1
    }
    assert tracker.observe(at(T0 + 9, buffered_groups=0, rollouts_consumed=50)).starved_since == {
        TRAINER: T0 + 1
    }
    # it consumed something (the buffer was refilled and drained between two reads): the clock restarts
    assert tracker.observe(at(T0 + 10, buffered_groups=0, rollouts_consumed=66)).starved_since == {
        TRAINER: T0 + 10
    }
    # a sync-mode trainer (no buffer) or an impostor is never starved
    assert tracker.observe(at(T0 + 11, buffered_groups=None, accepts_rollouts=False)).starved_since == {}
    assert tracker.observe(at(T0 + 12, buffered_groups=0, trusted=False)).starved_since == {}


def test_versions_per_minute_needs_ten_seconds_of_data():
    tracker = Tracker()
    tracker.observe(at(T0, version=1))
    tracker.observe(at(T0 + 5, version=3))
    assert tracker.versions_per_minute() is None
    tracker.observe(at(T0 + 30, version=11))
    assert tracker.versions_per_minute() == 20.0


def test_the_held_out_figures_are_a_series_of_the_history():
    tracker = Tracker()
    tracker.observe(at(T0))
    s = status(summary={"eval_version": 8, "eval_accuracy": 0.5, "eval_reward": 0.4})
    s["time"] = T0 + 1
    tracker.observe(s)
    samples = tracker.since(0, limit=10)
    assert [x["eval_accuracy"] for x in samples] == [None, 0.5]
    assert [x["eval_reward"] for x in samples] == [None, 0.4]
