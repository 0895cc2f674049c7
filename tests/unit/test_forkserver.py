"""``echo_p2p.forkserver``: processes forked from a helper that imported their modules once behave as
``python -m`` started ones do (argv, working directory, environment, own session, log, exit code, signals,
non-daemon threads and exit handlers at exit, fresh random numbers), a child asked to can start inside a
network namespace, and a helper that is gone says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from echo_p2p.forkserver import ForkServer, ForkServerError
from tests.netlab import skip_reason

MODULE = "tests.forked_child"
NETLAB_SKIP = skip_reason()  # root, iproute2 and a namespace made for a probe (tests/netlab.py)


@pytest.fixture(scope="module")
def server():
    forks = ForkServer(preload=("json",), modules=frozenset({MODULE}))
    yield forks
    forks.close()


def test_a_forked_child_runs_its_module_as_python_m_would(server, tmp_path):
    outs, procs = [], []
    for i in range(2):
        out = tmp_path / f"report-{i}.json"
        env = {**os.environ, "ECHO_TEST": f"value-{i}"}
        procs.append(
            server.spawn(
                MODULE,
                ["report", str(out)],
                log=tmp_path / f"log-{i}",
                cwd=str(tmp_path),
                env=env,
                name=f"peer-{i}",
            )
        )
        outs.append(out)
    assert [p.wait(60) for p in procs] == [3, 3] and [p.returncode for p in procs] == [3, 3]
    seen = [json.loads(out.read_text()) for out in outs]
    for i, (proc, got) in enumerate(zip(procs, seen, strict=True)):
        assert got["pid"] == got["pgid"] == proc.pid  # a session of its own: a group signal reaches only it
        assert got["cwd"] == str(tmp_path) and got["env"] == f"value-{i}" and got["name"] == "__main__"
        assert got["argv"] == ["report", str(outs[i])] and got["comm"] == f"peer-{i}"  # ps, top, psutil name
        log = (tmp_path / f"log-{i}").read_text()
        assert "to stdout" in log and "to stderr" in log
    assert seen[0]["random"] != seen[1]["random"]  # reseeded: not the helper's stream twice


def test_non_daemon_threads_and_exit_handlers_finish_before_the_exit(server, tmp_path):
    out = tmp_path / "linger"
    proc = server.spawn(MODULE, ["linger", str(out)], log=tmp_path / "log")
    assert proc.wait(60) == 0
    assert (tmp_path / "linger.thread").read_text() == "done"
    assert (tmp_path / "linger.atexit").read_text() == "done"


def test_an_uncaught_exception_exits_1_with_its_traceback_in_the_log(server, tmp_path):
    proc = server.spawn(MODULE, ["raise", str(tmp_path / "x")], log=tmp_path / "log")
    assert proc.wait(60) == 1
    assert "RuntimeError: boom from the forked child" in (tmp_path / "log").read_text()


def test_signals_reach_the_child_and_its_exit_says_which(server, tmp_path):
    (tmp_path / "log").write_text("an older run's log")
    proc = server.spawn(MODULE, ["sleep", str(tmp_path / "x")], log=tmp_path / "log")
    assert (tmp_path / "log").read_text() == ""  # there, and emptied, when spawn returns (as with Popen)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.5)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    proc.kill()  # after its exit: nothing to signal, no error


def test_a_module_it_does_not_fork_and_a_closed_helper_are_refused(tmp_path):
    forks = ForkServer(preload=(), modules=frozenset({MODULE}))
    with pytest.raises(ForkServerError, match="not started by the fork server"):
        forks.spawn("echo_p2p.peer", [], log=tmp_path / "log")
    assert forks.spawn(MODULE, ["linger", str(tmp_path / "l")], log=tmp_path / "log").wait(60) == 0
    # spawn_argv takes a command line: what it does not fork is None (the caller starts an interpreter)
    assert forks.spawn_argv(["-m", "echo_p2p.peer"], log=tmp_path / "log") is None
    assert forks.spawn_argv(["script.py", MODULE], log=tmp_path / "log") is None
    assert forks.spawn_argv(["-m", MODULE, "linger", str(tmp_path / "m")], log=tmp_path / "log").wait(60) == 0
    forks.close()
    assert not forks.usable
    with pytest.raises(ForkServerError):
        forks.spawn(MODULE, ["linger", str(tmp_path / "l")], log=tmp_path / "log")
    assert forks.spawn_argv(["-m", MODULE, "linger", str(tmp_path / "l")], log=tmp_path / "log") is None


@pytest.mark.skipif(NETLAB_SKIP is not None, reason=NETLAB_SKIP or "")
def test_a_child_started_in_a_network_namespace_runs_there_and_one_that_cannot_says_why(server, tmp_path):
    name = f"elfork{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    try:
        inside, outside = tmp_path / "inside.json", tmp_path / "outside.json"
        a = server.spawn(MODULE, ["report", str(inside)], log=tmp_path / "a.log", netns=name)
        b = server.spawn(MODULE, ["report", str(outside)], log=tmp_path / "b.log")
        assert a.wait(60) == 3 and b.wait(60) == 3, (tmp_path / "a.log").read_text()
        assert json.loads(inside.read_text())["netns"] == os.stat(f"/run/netns/{name}").st_ino
        assert json.loads(outside.read_text())["netns"] == os.stat("/proc/self/ns/net").st_ino
        missing = server.spawn(
            MODULE, ["report", str(tmp_path / "x")], log=tmp_path / "c.log", netns=name + "x"
        )
        assert missing.wait(60) == 1 and not (tmp_path / "x").exists()
        assert f"/run/netns/{name}x" in (tmp_path / "c.log").read_text()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_child_killed_holding_hiveminds_locks_does_not_block_the_next_ones(tmp_path):
    """hivemind makes cross-process locks when it is imported: made in the helper, every peer forked from it
    would share them, and one SIGKILLed while holding one would hang every later peer's DHT start (a suite
    run lost four tests that way). Each child gets its own."""
    forks = ForkServer(
        preload=("hivemind.utils.mpfuture", "hivemind.utils.asyncio"), modules=frozenset({MODULE})
    )
    started = []
    try:
        held = tmp_path / "held"
        holder = forks.spawn(MODULE, ["hold", str(held)], log=tmp_path / "hold.log")
        started.append(holder)
        deadline = time.monotonic() + 60
        while not held.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.read_text() == "held", (tmp_path / "hold.log").read_text()
        os.killpg(holder.pid, signal.SIGKILL)  # dies holding them
        assert holder.wait(30) == -signal.SIGKILL
        out = tmp_path / "future"
        child = forks.spawn(MODULE, ["future", str(out)], log=tmp_path / "future.log")
        started.append(child)
        assert child.wait(30) == 0, (tmp_path / "future.log").read_text()
        assert out.read_text() == "ok 7"
    finally:
        for proc in started:  # a child left hanging by a failure: stopped by its own group
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        forks.close()
