"""Where the CPU of a local swarm goes: every process of the README run, per second and per policy version.

Runs ``python -m echo_p2p.local`` (the README's run: a bootstrap, a trainer, 2 inference peers, async;
``--local-args`` adds flags, e.g. ``--peer-args='--config pacing-off.yaml'``) and, once a second, reads from
``/proc`` the CPU time (user + system) of every process it started: each peer's main process, its hivemind
DHT process (a forked child), a trainer's averager processes (forked by hivemind.Optimizer) and its p2pd
daemon, and every thread of them, by thread name (a peer forked from the local runner's fork server is
known by its process name, ``trainer-0``, ``inference-1``: its command line is the helper's). The part of the
run after the first training step is reported:

* CPU cores used by each process kind (trainer, its DHT, its p2pd, inference, ...), and CPU-seconds per
  policy version;
* the busiest threads of the trainer and of an inference peer;
* the run's summary line (consumed, waste, idle) from its ``summary.json``.

Prints a table and writes JSON (default ``benchmarks/results/profile.json``).

    .venv/bin/python benchmarks/profile_swarm.py [--duration 60] [--local-args '...'] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TICKS = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[int, str, float] | None:
    """(ppid, comm, cpu seconds) of a /proc/<pid> or /proc/<pid>/task/<tid> entry."""
    try:
        raw = Path(path, "stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), comm, (int(fields[11]) + int(fields[12])) / TICKS


def _descendants(root: int) -> dict[int, int]:
    """pid -> ppid of every process under ``root``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(f"/proc/{entry}")
            if st is not None:
                parents[int(entry)] = st[0]
    out: dict[int, int] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in out:
                out[child] = parent
                frontier.append(child)
    return out


def _kind(pid: int, ppid: int, root: int, kinds: dict[int, str]) -> str:
    """trainer / inference / bootstrap for a peer's main process; '<peer> dht' for its python child;
    '<peer> p2pd' for a daemon."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    exe = os.path.basename(cmd[0].decode(errors="replace")) if cmd and cmd[0] else "?"
    if ppid == root:
        args = [c.decode(errors="replace") for c in cmd]
        if "echo_p2p.bootstrap" in args:
            return "bootstrap"
        if "echo_p2p.forkserver" in args:
            return "forkserver"
        if "--role" in args:
            return args[args.index("--role") + 1]
        return exe
    if kinds.get(ppid) == "forkserver":
        # a peer forked from the fork server: its command line is the helper's, its name says what it is
        # (``trainer-0``, ``inference-1``: ``ForkServer.spawn``)
        st = _stat(f"/proc/{pid}")
        role = st[1].split("-")[0] if st is not None else "?"
        # (the local runner never forks the bootstrap)
        return role if role in ("trainer", "inference") else "forkserver child"
    parent = kinds.get(ppid, "?").split(" ")[0]
    if "p2pd" in exe:
        return f"{parent} p2pd"
    if not exe.startswith("python"):
        return f"{parent} {exe}"
    if any(kind == f"{parent} dht" for pid_, kind in kinds.items() if _ppid(pid_) == ppid):
        return (
            f"{parent} averager"  # the DHT is forked first; a trainer's optimizer forks its averagers later
        )
    return f"{parent} dht"


def _ppid(pid: int) -> int | None:
    st = _stat(f"/proc/{pid}")
    return None if st is None else st[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds the local run trains (default 60)")
    p.add_argument("--local-args", default="", help="more flags for python -m echo_p2p.local")
    p.add_argument("--out", default=str(HERE / "results" / "profile.json"), help="JSON results file")
    args = p.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="echo-profile-"))
    cmd = [
        sys.executable,
        "-m",
        "echo_p2p.local",
        "--duration",
        str(args.duration),
        "--workdir",
        str(workdir),
    ]
    cmd += shlex.split(args.local_args)
    launcher_log = workdir / "launcher.log"
    with open(launcher_log, "wb") as log:  # the launcher holds its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    kinds: dict[int, str] = {}
    threads: dict[tuple[int, int], tuple[str, float]] = {}  # (pid, tid) -> (name, cpu s at the last read)
    first: dict[tuple[int, int], float] = {}  # cpu s at the first read after the first step
    started = None
    while proc.poll() is None:
        time.sleep(1.0)
        if started is None and any((workdir / "metrics").glob("trainer-*.jsonl")):
            trainer = next((workdir / "metrics").glob("trainer-*.jsonl"))
            if any('"step": 1,' in line for line in trainer.read_text().splitlines()):
                started = time.monotonic()
        for pid, ppid in _descendants(proc.pid).items():
            if kinds.get(pid, "forkserver child") == "forkserver child":  # (named just after its fork)
                kinds[pid] = _kind(pid, ppid, proc.pid, kinds)
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                st = _stat(f"/proc/{pid}/task/{tid}")
                if st is None:
                    continue
                key = (pid, int(tid))
                threads[key] = (st[1], st[2])
                if started is not None and key not in first:
                    first[key] = st[2] if time.monotonic() - started < 1.5 else 0.0
    if started is None:  # e.g. a --local-args value the launcher refused: say so instead of a table of nan
        tail = launcher_log.read_text(errors="replace")[-3000:]
        sys.exit(f"the local run (exit {proc.returncode}) never made a first training step:\n{tail}")
    span = time.monotonic() - started

    by_kind: dict[str, float] = defaultdict(float)
    by_thread: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (pid, _), (name, cpu) in threads.items():
        if (pid, _) not in first:
            continue
        used = cpu - first[(pid, _)]
        by_kind[kinds.get(pid, "?")] += used
        by_thread[kinds.get(pid, "?")][name] += used
    summary = (
        json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
    )
    versions = summary.get("versions") or 0
    inference_kinds = sum(1 for k in set(kinds.values()) if k == "inference")
    rows = sorted(by_kind.items(), key=lambda kv: -kv[1])
    print(
        f"local run of {args.duration:.0f} s, {span:.0f} s profiled after the first step, {versions} versions"
    )
    print(f"{'process':<20} {'cores':>6} {'cpu-s/version':>14}")
    for kind, used in rows:
        print(f"{kind:<20} {used / span:6.2f} {used / max(1, versions):14.4f}")
    machinery = sum(
        v for k, v in by_kind.items() if k.endswith(("dht", "p2pd", "averager")) or k == "bootstrap"
    )
    print(f"{'DHT+p2pd+avg+boot':<20} {machinery / span:6.2f} {machinery / max(1, versions):14.4f}")
    for kind in ("trainer", "inference"):
        top = sorted(by_thread.get(kind, {}).items(), key=lambda kv: -kv[1])[:6]
        print(f"{kind} threads: " + ", ".join(f"{n} {v / span:.2f}" for n, v in top))
    keys = ("rollouts_per_second", "groups_sampled", "stale_fraction", "trainer_idle_fraction")
    print("run: " + ", ".join(f"{k} {summary.get(k)}" for k in keys))
    out = {
        "duration": args.duration,
        "profiled_seconds": span,
        "versions": versions,
        "inference_processes": inference_kinds,
        "cores_by_process": {k: v / span for k, v in rows},
        "cpu_seconds_per_version": {k: v / max(1, versions) for k, v in rows},
        "machinery_cores": machinery / span,
        "threads": {k: {n: v / span for n, v in t.items()} for k, t in by_thread.items()},
        "summary": summary,
        "local_args": args.local_args,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
