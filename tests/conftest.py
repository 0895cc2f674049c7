"""Shared test fixtures: subprocesses in their own process groups, cleaned up by group id, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from echo_p2p.forkserver import ForkServer

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def pytest_collection_modifyitems(config, items):
    # the longer files (marked slow) first, the longest first (``slow(seconds)``: the file's seconds on 2 cores
    # beside another file, for this order only): on two workers (scripts/test.sh, with xdist's own reorder by
    # test count turned off) the short files then fill the gaps instead of one long file running alone at the
    # end. Stable, by file: a file's tests stay together in order
    def order(item) -> tuple[int, float]:
        slow = item.get_closest_marker("slow")
        return (1, 0.0) if slow is None else (0, -float(slow.args[0]) if slow.args else 0.0)

    items.sort(key=order)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_forks: ForkServer | None = None


def fork_server() -> ForkServer | None:
    """This test process's fork server (``echo_p2p.forkserver``), started at its first peer: every peer a test
    starts with this interpreter is forked from it instead of importing torch & co. again (~5 CPU-s each).
    None once it failed; ``ECHO_TEST_NO_FORK_SERVER=1`` starts every peer as a new interpreter."""
    global _forks
    if os.environ.get("ECHO_TEST_NO_FORK_SERVER") == "1":
        return None
    if _forks is None:
        _forks = ForkServer()
    return _forks if _forks.usable else None


def pytest_sessionfinish(session, exitstatus):
    if _forks is not None:
        _forks.close()


class Procs:
    """Starts echo_p2p CLIs as subprocesses, each in its own session, and kills only those groups. A peer
    (``-m echo_p2p.peer`` with this interpreter) is forked from the fork server."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []
        self._n = 0

    def start(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        name: str | None = None,
        python: str | None = None,
    ) -> subprocess.Popen:
        """``python args...`` (this interpreter unless another environment's is given)."""
        self._n += 1
        log = self.workdir / f"{name or 'proc'}-{self._n}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        forks = fork_server() if python is None else None
        forked = (
            forks.spawn_argv(args, log=log, cwd=str(self.workdir), env=full_env, name=name or "")
            if forks is not None
            else None
        )
        if forked is not None:
            forked.log_path = log  # type: ignore[attr-defined]
            self.procs.append(forked)  # type: ignore[arg-type]
            return forked  # type: ignore[return-value]
        proc = subprocess.Popen(
            [python or sys.executable, *args],
            cwd=str(self.workdir),
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )
        proc.log_path = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def bootstrap(self, *extra: str, identity: str | None = None) -> tuple[subprocess.Popen, str]:
        maddrs_file = self.workdir / f"bootstrap-{self._n + 1}.maddrs"
        args = ["-m", "echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs_file)]
        if identity:
            args += ["--identity-path", identity]
        proc = self.start(*args, *extra, name="bootstrap")
        wait_until(lambda: maddrs_file.exists() or proc.poll() is not None, 60, what="bootstrap start")
        assert proc.poll() is None, f"bootstrap exited: {read_log(proc)}"
        return proc, maddrs_file.read_text().split()[0]

    def peer(
        self, role: str, run_id: str, maddr: str, *extra: str, python: str | None = None
    ) -> subprocess.Popen:
        return self.start(
            "-m",
            "echo_p2p.peer",
            "--role",
            role,
            "--run-id",
            run_id,
            "--initial-peers",
            maddr,
            "--host-maddrs",
            LOOPBACK,
            *extra,
            name=role,
            python=python,
        )

    def kill_group(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def cleanup(self) -> None:
        # a polite stop first (a trainer leaves its run, writes its checkpoint), but not waited for long:
        # nothing is checked after a test, and a clean stop on 2 busy cores took up to 10 s of the suite's time
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 4
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.kill_group(proc, signal.SIGKILL)  # whatever is left of the group (p2pd, DHT child)


def read_log(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def metrics_lines(metrics: Path, peer_id: str, since: float = 0.0) -> list[dict]:
    """The metrics lines of one peer (``<role>-<peer id>.jsonl`` in ``metrics``) written at or after ``since``."""
    from echo_p2p.metrics import read_metrics

    path = next(iter(metrics.glob(f"*-{peer_id}.jsonl")), None)
    return [x for x in read_metrics(str(path)) if x["time"] >= since] if path else []


def newest_line(metrics: Path, peer_id: str, key: str, since: float = 0.0) -> dict | None:
    """That peer's newest metrics line with ``key``, or None."""
    found = [x for x in metrics_lines(metrics, peer_id, since) if x.get(key) is not None]
    return found[-1] if found else None


def trainer_steps(metrics_dir: Path) -> list[dict]:
    """Every training step line of every trainer in ``metrics_dir``, oldest first."""
    from echo_p2p.metrics import read_metrics

    lines: list[dict] = []
    for path in metrics_dir.glob("trainer-*.jsonl"):
        lines += [x for x in read_metrics(str(path)) if "step" in x and "reward_mean" in x]
    return sorted(lines, key=lambda x: x["time"])


def eval_lines(metrics_dir: Path, role: str = "trainer") -> list[dict]:
    """Every held-out evaluation line of ``role``'s peers in ``metrics_dir``, oldest first."""
    from echo_p2p.metrics import read_metrics

    lines: list[dict] = []
    for path in metrics_dir.glob(f"{role}-*.jsonl"):
        lines += [x for x in read_metrics(str(path)) if x.get("event") == "eval"]
    return sorted(lines, key=lambda x: x["time"])


def mean(xs):
    return sum(xs) / len(xs)


def wait_until(predicate, timeout: float, period: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def status_reader(maddr: str, run_ids: list[str], workdir: Path):
    """``echo_p2p.swarm.StatusReader`` for ``run_ids`` through the bootstrap ``maddr``, with the targets the
    ``status`` command's flags give: what it prints, read in this process through one DHT node for every poll
    (the command starts a node per call, ~4 s on 2 cores, which made polling tests slow and their deadlines
    coarse)."""
    from echo_p2p.monitor.target import resolve_target
    from echo_p2p.swarm import StatusReader, build_parser

    targets = {}
    for run_id in run_ids:
        args = ["status", "--run-id", run_id, "--initial-peers", maddr, "--host-maddrs", LOOPBACK]
        args += ["--identity-path", str(workdir / "status-reader.id")]
        targets[run_id] = resolve_target(build_parser().parse_args(args))
    return StatusReader(targets)


class LabProcs(Procs):
    """``Procs`` on an emulated internet (``tests/netlab.py``): the bootstrap and each trainer on a public
    host of their own, each inference peer at home behind its own NAT router. A process restarted with the
    same identity file runs on the same host again; loopback listen addresses become all-interfaces."""

    def __init__(self, workdir: Path, lab, uplink_mbit: float = 20, downlink_mbit: float = 100) -> None:
        super().__init__(workdir)
        self.lab = lab
        self.links = (uplink_mbit, downlink_mbit)  # of every home host
        self.hosts: dict[str, object] = {}

    def host_for(self, name: str, args: tuple[str, ...]):
        key = args[args.index("--identity-path") + 1] if "--identity-path" in args else f"{name}-{self._n}"
        if key not in self.hosts:
            if name == "inference":
                self.hosts[key] = self.lab.home_host(f"home{len(self.hosts)}", *self.links)
            else:
                self.hosts[key] = self.lab.public_host(f"{name}{len(self.hosts)}")
        return self.hosts[key]

    def start(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        name: str | None = None,
        python: str | None = None,
    ):
        self._n += 1
        log = self.workdir / f"{name or 'proc'}-{self._n}.log"
        host = self.host_for(name or "proc", args)
        argv = [python or sys.executable, *("/ip4/0.0.0.0/tcp/0" if a == LOOPBACK else a for a in args)]
        proc = self.lab.spawn(host, argv, log, env=env, cwd=self.workdir)
        proc.log_path = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def bootstrap(self, *extra: str, identity: str | None = None) -> tuple[subprocess.Popen, str]:
        host = self.host_for("bootstrap", tuple(extra))
        maddrs_file = self.workdir / f"bootstrap-{self._n + 1}.maddrs"
        args = ["-m", "echo_p2p.bootstrap", "--host-maddrs", f"/ip4/{host.address}/tcp/31337"]
        args += ["--maddrs-file", str(maddrs_file), *(["--identity-path", identity] if identity else [])]
        self._n += 1
        log = self.workdir / f"bootstrap-{self._n}.log"
        proc = self.lab.spawn(host, [sys.executable, *args, *extra], log, cwd=self.workdir)
        proc.log_path = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        wait_until(lambda: maddrs_file.exists() or proc.poll() is not None, 60, what="bootstrap start")
        assert proc.poll() is None, f"bootstrap exited: {read_log(proc)}"
        return proc, next(m for m in maddrs_file.read_text().split() if host.address in m)


@pytest.fixture
def lab_procs(tmp_path: Path) -> Iterator[LabProcs]:
    """``LabProcs`` on a fresh ``NetLab`` (the test skips where the lab cannot run, saying why)."""
    from tests.netlab import NetLab, skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with NetLab(forks=fork_server()) as lab:
        p = LabProcs(tmp_path, lab)
        try:
            yield p
        finally:
            p.cleanup()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


def write_run_record(
    path: Path, run_id: str, owner, trainers: list[str], mode: str = "async", model: str = "tiny"
) -> Path:
    """A run record of ``run_id`` (``model``, ``count`` task, ``mode``, valid for an hour) listing
    ``trainers``, signed by the ``owner`` identity and written to ``path``, as ``echo_p2p.owner sign`` does."""
    from echo_p2p.net import run_record as rr

    now = time.time()
    record = rr.RunRecord(
        run_id=run_id,
        owner_key=owner.public_key_bytes().decode(),
        trainers=trainers,
        serial=1,
        issued_at=now,
        expires_at=now + 3600,
        model=model,
        task="count",
        mode=mode,
    )
    rr.write_file(path, *rr.sign(record, owner))
    return path


def save_vllm_tiny_model(directory: Path, seed: int = 0) -> Path:
    """The tiny preset with 32-wide attention heads (vLLM's CPU attention takes head sizes 32..512; the
    preset's are 16), saved with the preset's tokenizer: a model directory every engine can load."""
    from echo_p2p.ml.models import build_tiny_policy, save_policy

    return save_policy(*build_tiny_policy(seed, head_dim=32), directory)
