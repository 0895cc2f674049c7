"""journal.py and its users: acknowledged groups survive the trainer's death until they are used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from echo_p2p.roles.trainer.intake import AsyncIntake, open_journal
from echo_p2p.train.buffer import AddResult, ReplayBuffer
from echo_p2p.train.journal import JOURNAL_NAME, IntakeJournal
from tests.unit.conftest import make_group


def _g(i: int, version: int = 0):
    return make_group([2, 3], [[4, i % 7 + 2], [5]], [float(i), 0.5], version=version, rollout_id=f"r{i}")


def _ids(groups) -> list[str]:
    return [g.rollout_id for g in groups]


def test_recover_returns_the_unsettled_groups_in_order_with_their_rewards(tmp_path) -> None:
    path = tmp_path / JOURNAL_NAME
    j = IntakeJournal(path).open()
    for i in range(6):
        j.added(_g(i, version=i))
    j.settled(["r1", "r4", "never-added"])
    j.close()
    back = IntakeJournal(path).recover()
    assert _ids(back) == ["r0", "r2", "r3", "r5"]
    assert back[1].rewards == (2.0, 0.5) and back[1].policy_version == 2
    assert back[1].group == _g(2, version=2).group
    # recovering rewrote the file with only those: a second recovery reads the same
    assert _ids(IntakeJournal(path).recover()) == ["r0", "r2", "r3", "r5"]


def test_open_without_resume_starts_empty(tmp_path) -> None:
    path = tmp_path / JOURNAL_NAME
    j = IntakeJournal(path).open()
    j.added(_g(0))
    j.close()
    IntakeJournal(path).open().close()
    assert IntakeJournal(path).recover() == []


def test_every_acknowledged_group_survives_sigkill(tmp_path) -> None:
    """What ``added`` returned from is on disk even if the process is killed the next instant."""
    path = tmp_path / JOURNAL_NAME
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from echo_p2p.train.journal import IntakeJournal
        from tests.unit.train.test_journal import _g
        j = IntakeJournal({str(path)!r}).open()
        for i in range(50):
            j.added(_g(i))
        j.settled(["r7", "r8"])
        print("acked", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "acked" in proc.stdout
    back = IntakeJournal(path).recover()
    assert _ids(back) == [f"r{i}" for i in range(50) if i not in (7, 8)]


def test_a_torn_or_corrupt_tail_is_cut_off_and_the_rest_kept(tmp_path) -> None:
    path = tmp_path / JOURNAL_NAME
    j = IntakeJournal(path).open()
    for i in range(3):
        j.added(_g(i))
    j.close()
    whole = path.read_bytes()
    path.write_bytes(whole + whole[: len(whole) // 5])  # a record cut in the middle of its write
    j = IntakeJournal(path)
    assert _ids(j.recover()) == ["r0", "r1", "r2"]
    j.added(_g(3))  # appends after the cut, readable
    j.close()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the last record's bytes no longer match its checksum
    path.write_bytes(bytes(data))
    assert _ids(IntakeJournal(path).recover()) == ["r0", "r1", "r2"]


def test_the_file_is_compacted_to_what_is_live(tmp_path) -> None:
    path = tmp_path / JOURNAL_NAME
    j = IntakeJournal(path, compact_bytes=4096).open()
    for i in range(400):
        j.added(_g(i))
        if i >= 3:
            j.settled([f"r{i - 3}"])
    stats = j.snapshot()
    assert stats["compactions"] >= 1 and stats["live"] == 3
    assert os.path.getsize(path) < 4096 * 2
    j.close()
    assert _ids(IntakeJournal(path).recover()) == ["r397", "r398", "r399"]


def test_the_buffer_journals_what_it_adds_and_settles_what_it_throws_away(tmp_path) -> None:
    j = IntakeJournal(tmp_path / JOURNAL_NAME).open()
    buf = ReplayBuffer(capacity=3, max_staleness=1, journal=j)
    for i in range(3):
        assert buf.add(_g(i, version=i)) is AddResult.ADDED
    assert buf.add(_g(0, version=0)) is AddResult.DUPLICATE  # not journaled twice
    assert buf.add(_g(3, version=3)) is AddResult.ADDED  # full: r0, the oldest, is evicted
    assert len(j) == 3
    assert buf.drop_stale(3) == 1  # r1 (version 1) is too stale at 3
    taken = buf.take(1, current_version=3)  # handed out, not yet used: kept
    assert _ids(taken) == ["r2"]
    buf.drop_sender(_g(3).group.sampler_peer_id)  # r3's sender is banned: its groups go for good
    j.close()
    assert _ids(IntakeJournal(tmp_path / JOURNAL_NAME).recover()) == ["r2"]


def _section(tmp_path, resume: bool):
    return SimpleNamespace(
        prompts_per_step=2, max_staleness=1, checkpoint_dir=str(tmp_path), journal=True, resume=resume
    )


def test_async_intake_settles_a_batch_once_its_version_is_reached_and_recovers_the_rest(tmp_path) -> None:
    section = _section(tmp_path, resume=False)
    buf = ReplayBuffer(capacity=16, max_staleness=1)
    intake = AsyncIntake(buf, section, open_journal(section))
    intake.recover(0)  # an empty journal: nothing back, the buffer now journals
    for i in range(5):
        buf.add(_g(i, version=0))
    batch = intake.collect(0)
    assert len(batch) == 2
    intake.used(batch)
    # killed before the step's version was reached: the batch is still owed
    intake.close()
    again = AsyncIntake(ReplayBuffer(capacity=16, max_staleness=1), _section(tmp_path, resume=True), None)
    again.journal = open_journal(_section(tmp_path, resume=True))
    again.recover(0)
    assert again.recovered == 5 and again.recovered_stale == 0

    batch = again.collect(0)
    again.used(batch)
    again.reached(1)  # the version the batch went into: settled
    left = again.collect(1)  # two more, taken but not yet a step
    assert len(left) == 2
    again.discarded(left)  # thrown away (not finite): settled too
    again.close()
    third = AsyncIntake(ReplayBuffer(capacity=16, max_staleness=1), section, None)
    third.journal = open_journal(_section(tmp_path, resume=True))
    third.recover(3)  # the one group left is of version 0: too stale at 3, counted and settled
    assert third.recovered == 0 and third.recovered_stale == 1
    third.close()
    assert IntakeJournal(tmp_path / JOURNAL_NAME).recover() == []


def test_no_journal_without_a_checkpoint_dir_or_when_turned_off(tmp_path) -> None:
    assert open_journal(SimpleNamespace(checkpoint_dir=None, journal=True, resume=False)) is None
    assert open_journal(SimpleNamespace(checkpoint_dir=str(tmp_path), journal=False, resume=True)) is None


def test_a_restarted_trainer_buffers_every_recovered_group_even_beyond_its_starting_size(tmp_path) -> None:
    section = _section(tmp_path, resume=False)
    buf = ReplayBuffer(capacity=8, max_staleness=1)
    intake = AsyncIntake(buf, section, open_journal(section))
    intake.recover(0)
    for i in range(8):
        buf.add(_g(i, version=0))
    intake.close()
    # restarted before any sender is seen: its buffer starts smaller than the one it had
    again = AsyncIntake(ReplayBuffer(capacity=3, max_staleness=1), _section(tmp_path, resume=True), None)
    again.journal = open_journal(_section(tmp_path, resume=True))
    again.recover(0)
    assert again.recovered == 8 and len(again.buffer) == 8 and again.buffer.stats().evicted == 0
    again.close()
