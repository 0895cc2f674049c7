"""The watchdog (``roles.watchdog``): a due signal without progress past its deadline is a stall (logged with
every thread's stack), progress or the end of its due time is a recovery, and a stall announced by a peer
reaches ``swarm status``, the monitor's row and its ``peer_stalled`` alert."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from echo_p2p.cli import EXIT_STALLED
from echo_p2p.monitor.alerts import evaluate
from echo_p2p.monitor.config import MonitorConfig
from echo_p2p.monitor.status import Snapshot, build_status
from echo_p2p.net.records import MAX_STALLED_SIGNALS, PeerRecord, RecordError
from echo_p2p.roles.watchdog import MAX_STALLED, Watchdog, WatchdogConfig, dump_threads
from echo_p2p.swarm import format_table
from tests.unit.monitor.fakes import INF_A, TRAINER, peer, row, status, trainer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(deadline: float = 10.0, due=None, **kw) -> tuple[Watchdog, Clock, list[list[str]]]:
    clock, calls = Clock(), []
    dog = Watchdog(WatchdogConfig(), clock=clock, on_stall=calls.append, **kw)
    dog.watch("work", deadline, due)
    return dog, clock, calls


def test_a_due_signal_without_progress_past_its_deadline_stalls_once_with_a_thread_dump(caplog):
    parked = threading.Event()
    waiter = threading.Thread(target=parked.wait, args=(30,), name="stuck-fetch", daemon=True)
    waiter.start()
    dog, clock, calls = make(10.0)
    try:
        with caplog.at_level(logging.ERROR, logger="echo_p2p.roles.watchdog"):
            assert dog.check() == []
            clock.now += 9.0
            assert dog.check() == [] and dog.stalled == []
            clock.now += 2.0
            assert dog.check() == ["work"]
            clock.now += 5.0
            assert dog.check() == []  # reported once, not on every look
    finally:
        parked.set()
    assert dog.stalled == ["work"] and dog.stalls_total == 1 and calls == [["work"]]
    assert dog.figures() == {"stalls_total": 1, "stalled": ["work"]}
    text = caplog.text
    assert "stalled: work no progress for 11.0 s (deadline 10 s)" in text
    assert 'Thread "stuck-fetch"' in text and "wait" in text  # what the stuck thread waits on
    assert "child processes:" in text


def test_progress_in_time_is_no_stall_and_progress_after_a_stall_is_a_recovery(caplog):
    dog, clock, calls = make(10.0)
    for _ in range(5):
        clock.now += 8.0
        dog.beat("work")
        assert dog.check() == []
    clock.now += 11.0
    assert dog.check() == ["work"]
    clock.now += 4.0
    dog.beat("work")
    with caplog.at_level(logging.WARNING, logger="echo_p2p.roles.watchdog"):
        assert dog.check() == []
    assert dog.stalled == [] and "recovered: work progress resumed after 4.0 s" in caplog.text
    clock.now += 11.0
    assert dog.check() == ["work"] and dog.stalls_total == 2


def test_nothing_is_expected_while_not_due_and_the_deadline_counts_from_when_it_became_due(caplog):
    due = [False]
    dog, clock, calls = make(10.0, due=lambda: due[0])
    clock.now += 500.0  # idle for want of work: no stall
    assert dog.check() == []
    due[0] = True
    assert dog.check() == []  # the last progress is long ago, but it is due only from now
    clock.now += 9.0
    assert dog.check() == []
    clock.now += 2.0
    assert dog.check() == ["work"]
    due[0] = False
    with caplog.at_level(logging.WARNING, logger="echo_p2p.roles.watchdog"):
        assert dog.check() == []
    assert dog.stalled == [] and "no longer due" in caplog.text


def test_a_failing_due_predicate_counts_as_not_due():
    dog, clock, _ = make(1.0, due=lambda: 1 / 0)
    clock.now += 100.0
    assert dog.check() == [] and dog.stalled == []


def test_the_stalled_names_are_bounded_and_the_dump_is_bounded():
    clock = Clock()
    dog = Watchdog(clock=clock)
    for i in range(MAX_STALLED + 4):
        dog.watch(f"signal-{i:02d}", 1.0)
    dog.check()
    clock.now += 2.0
    assert len(dog.check()) == MAX_STALLED + 4
    assert len(dog.stalled) == MAX_STALLED and dog.stalls_total == MAX_STALLED + 4
    with pytest.raises(ValueError):
        dog.watch("x" * 33, 1.0)
    assert len(dump_threads(max_chars=300)) < 400
    one_frame = dump_threads(max_frames=1)
    # at most one frame per thread listed (threads come and go, and _current_frames also sees threads that
    # threading did not start: counting the dump's own threads, not threading.active_count())
    assert one_frame.count('File "') <= one_frame.count('Thread "')


def test_the_checker_thread_finds_a_stall_on_the_real_clock():
    found = threading.Event()
    dog = Watchdog(on_stall=lambda names: found.set())
    dog.watch("announce", 0.2)
    dog.start()
    try:
        assert found.wait(5), "no stall found within 5 s of a 0.2 s deadline"
        assert dog.stalled == ["announce"] and 0.04 <= dog.period() <= 0.06
    finally:
        dog.stop()


def test_a_disabled_watchdog_does_not_check():
    dog = Watchdog(WatchdogConfig(enabled=False), on_stall=lambda names: pytest.fail("checked"))
    dog.watch("announce", 0.05)
    dog.start()
    time.sleep(0.3)
    assert dog._thread is None and dog.stalled == []


def test_exit_stalled_kills_the_children_and_exits_75_while_a_thread_hangs(tmp_path):
    """What ``--restart-on-stall`` ends with: children (the DHT child, p2pd) killed by parent pid, then
    ``os._exit`` whatever hangs (here a non-daemon thread that would keep a clean exit waiting forever)."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(
        f"""
        import subprocess, sys, threading
        from echo_p2p.roles.watchdog import exit_stalled
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        threading.Thread(target=threading.Event().wait).start()  # never ends
        exit_stalled(0.1, "test")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == EXIT_STALLED == 75, proc.stderr
    import psutil

    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child outlived the stalled process"
        time.sleep(0.05)


# ---- the stall in the record, swarm status and the monitor ------------------------------------------------
def test_the_record_carries_bounded_stalled_names_and_older_records_stay_valid():
    wire = PeerRecord(peer_id="QmX", role="trainer", stalled=["training"]).to_wire()
    assert PeerRecord.from_wire(wire).stalled == ["training"]
    older = {k: v for k, v in wire.items() if k != "stalled"}
    assert PeerRecord.from_wire(older).stalled is None
    for bad in (["x"] * (MAX_STALLED_SIGNALS + 1), ["x" * 33], [""], "training"):
        with pytest.raises(RecordError):
            PeerRecord.from_wire({**wire, "stalled": bad})


def test_a_stalled_peer_is_a_status_row_a_table_state_and_an_alert():
    snap = Snapshot(run_id="r", time=time.time(), peers=[trainer(stalled=["training"]), peer(INF_A)])
    built = build_status(snap)
    rows = {r["peer_id"]: r for r in built["peers"]}
    assert rows[TRAINER]["stalled"] == ["training"] and rows[INF_A]["stalled"] is None
    alerts = [a for a in built["alerts"] if a["code"] == "peer_stalled"]
    assert len(alerts) == 1 and alerts[0]["peers"] == [TRAINER] and alerts[0]["severity"] == "warning"
    assert "training" in alerts[0]["message"]
    for r in built["peers"]:
        r["last_seen_s"] = 1.0
    table = format_table("r", built["peers"]).splitlines()
    assert table[2].split()[2] == "STALLED" and table[3].split()[2] == "running"


def test_peer_stalled_is_silent_without_a_stall_and_for_a_peer_that_is_leaving():
    config = MonitorConfig()
    assert not [a for a in evaluate(status(), config) if a["code"] == "peer_stalled"]
    leaving = status(peers=[row(TRAINER, "trainer"), row(INF_A, state="leaving", stalled=["announce"])])
    assert not [a for a in evaluate(leaving, config) if a["code"] == "peer_stalled"]


# ---- the roles' due predicates: progress is expected only when it can happen -----------------------------
def test_a_trainer_is_due_to_step_while_it_holds_a_batch_and_a_stuck_step_stalls(tmp_path):
    from echo_p2p.roles.trainer.intake import AsyncIntake
    from echo_p2p.roles.trainer.peer import TrainerPeer
    from echo_p2p.train.buffer import ReplayBuffer
    from tests.unit.conftest import make_group, unstarted_peer

    t = unstarted_peer(TrainerPeer, tmp_path, "--prompts-per-step", "4")
    assert not t._training_due()  # not started: nothing to do
    buffer = ReplayBuffer(capacity=16, max_staleness=1)
    t.intake = AsyncIntake(buffer, t.section)
    assert not t._training_due()  # idle for want of rollouts: no stall
    for i in range(4):
        buffer.add(make_group([2, 3], [[4, 2], [5]], [float(i), 0.5], rollout_id=f"r{i}"), 0)
    assert t._training_due()  # a batch is buffered: the loop must come round
    assert t.intake.collect(0) is not None and not t._training_due()
    t._in_step = True
    assert t._training_due()  # in a step
    clock = Clock()
    dog = Watchdog(clock=clock)
    dog.watch("training", 30.0, t._training_due)
    dog.check()
    clock.now += 31.0  # the step never ends (an averaging round that hangs)
    assert dog.check() == ["training"]


def test_an_inference_peer_is_due_to_apply_a_version_a_trainer_reported_and_to_sample_with_room(tmp_path):
    from echo_p2p.roles.inference import InferencePeer
    from tests.unit.conftest import unstarted_peer

    p = unstarted_peer(InferencePeer, tmp_path)
    p.policy_version = 5
    p.fetcher = type("F", (), {"nudge": lambda self: None})()
    p.pusher = type("P", (), {"full": False, "outbox_full": lambda self: self.full})()
    assert not p._version_due()
    p._on_trainer_version(8)  # an ack: the trainer is at 8
    assert p._version_due() and p._newest_known == 8
    clock = Clock()
    dog = Watchdog(clock=clock)
    dog.watch("version", 20.0, p._version_due)
    dog.check()
    clock.now += 21.0  # the fetch of 8 never ends
    assert dog.check() == ["version"]
    p.policy_version = 8  # applied at last
    assert not p._version_due() and dog.check() == [] and dog.stalled == []
    assert p._sampling_due()
    p.pusher.full = True  # waiting for the trainers to take what it sent: not this peer's stall
    assert not p._sampling_due()
    p.pusher.full, p.policy_version = False, None
    assert not p._sampling_due()  # no policy yet
