"""Start-up of each entry point: launch -> first useful act, the imports on the way, torch or not.

Each entry point runs as a fresh process (``-X importtime``), ``--repeats`` times per tree, the trees taking
turns (before, after, before, ...) so that the machine's load falls on both alike:
- ``bootstrap``: ``python -m echo_p2p.bootstrap --run-record ...`` until its multiaddrs file is written;
- ``swarm status``: ``python -m echo_p2p.swarm status --join ... --json`` until it exits;
- ``monitor``: ``python -m echo_p2p.monitor --join ...`` until it prints its URL;
- ``peer trainer`` / ``peer inference``: ``python -m echo_p2p.peer --role ... --join ...`` until it logs
  ``joined run`` (DHT up, first record stored; the model and task are loaded by then);
- ``local``: ``python -m echo_p2p.local`` until it has spawned the bootstrap (its log file exists).
All of them join one bootstrap of this tree (with a signed run record) started beforehand.

Per entry point and tree it reports medians: wall seconds from launch to that act; import seconds (the sum
of ``-X importtime``'s top-level cumulative times: every import the process ran up to its exit, lazy ones
included); modules imported and peak RSS (this process, not its p2pd or DHT child) when the act
happened; whether torch, scipy and transformers were among them.
``--before DIR`` adds a column for another tree (e.g. ``git worktree add --detach DIR <commit>``), run with
its own code through PYTHONPATH. Prints a table and writes JSON (default ``benchmarks/results/startup.json``).

    .venv/bin/python benchmarks/startup.py [--repeats 5] [--before DIR] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dht import stop  # a sibling script (this folder is first on the path): stops a process group by its id

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
HEAVY = ("torch", "scipy", "transformers")
RUN_ID = "startup-bench"

#: Runs the entry point as ``python -m MODULE ARGS``; writes what is imported to $STARTUP_REPORT once the
#: benchmark creates $STARTUP_READY (the act happened) or at exit, whichever comes first.
WRAPPER = """
import atexit, json, os, runpy, sys, threading, time
heavy = set(sys.argv[1].split(","))
def report():
    if os.path.exists(os.environ["STARTUP_REPORT"]):
        return
    top = {m.split(".")[0] for m in list(sys.modules)}
    with open(os.environ["STARTUP_REPORT"] + ".tmp", "w") as f:
        # VmHWM: this image's peak (ru_maxrss would keep the forking parent's across exec)
        with open("/proc/self/status") as status:
            rss = next(int(x.split()[1]) for x in status if x.startswith("VmHWM")) / 1024
        json.dump({"modules": len(sys.modules), "heavy": sorted(top & heavy), "max_rss_mb": rss}, f)
    os.replace(os.environ["STARTUP_REPORT"] + ".tmp", os.environ["STARTUP_REPORT"])
def watch():
    while not os.path.exists(os.environ["STARTUP_READY"]):
        time.sleep(0.01)
    report()
threading.Thread(target=watch, daemon=True).start()
atexit.register(report)
module = sys.argv[2]
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

IMPORTTIME = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)")


def import_seconds(stderr: str) -> float:
    """Sum of the cumulative times of top-level imports (those no other import's body ran)."""
    total = 0
    for line in stderr.splitlines():
        match = IMPORTTIME.match(line)
        if match and not match[2]:  # no indent: depth 0
            total += int(match[1])
    return total / 1e6


def run_entry(tree: Path, args: list[str], ready, workdir: Path, timeout: float = 120.0) -> dict:
    """Launch ``python -X importtime -c WRAPPER HEAVY args...`` with ``tree`` first on the path; ``ready(log)``
    says when the act happened. Returns wall seconds, import seconds, modules and heavy packages."""
    tag = f"{time.monotonic_ns()}"
    report, flag, log = (workdir / f"{tag}.{ext}" for ext in ("json", "ready", "log"))
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    env.update(STARTUP_REPORT=str(report), STARTUP_READY=str(flag))
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-c", WRAPPER, ",".join(HEAVY), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(workdir),
            env=env,
            start_new_session=True,
        )
        try:
            while not ready(log.read_text(errors="replace")):
                if proc.poll() is not None and not ready(log.read_text(errors="replace")):
                    if proc.returncode != 0 or not report.exists():
                        raise RuntimeError(f"{args} exited {proc.returncode}: {log.read_text()[-2000:]}")
                    break
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{args}: no act within {timeout} s: {log.read_text()[-2000:]}")
                time.sleep(0.01)
            wall = time.monotonic() - t0
            flag.touch()
            _wait(report.exists, 10)
        finally:
            stop(proc)
    facts = json.loads(report.read_text())
    return {"wall_s": wall, "import_s": import_seconds(log.read_text(errors="replace")), **facts}


def _wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def entries(join: str, record: Path, workdir: Path) -> dict[str, tuple[list[str], object]]:
    """name -> (arguments after the interpreter, ready(log text)); ``workdir``: this run's own folder."""
    peer = ["echo_p2p.peer", "--join", join, "--host-maddrs", LOOPBACK, "--model", "tiny", "--task", "count"]
    peer += ["--mode", "async"]
    return {
        "bootstrap": (
            ["echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--run-record", str(record)],
            lambda log: "Peers join this swarm with" in log,
        ),
        "swarm status": (
            ["echo_p2p.swarm", "status", "--join", join, "--json"],
            lambda log: False,  # its act is its exit
        ),
        "monitor": (
            ["echo_p2p.monitor", "--join", join, "--port", "0"],
            lambda log: "monitor of run" in log,
        ),
        "peer trainer": ([*peer, "--role", "trainer"], lambda log: "joined run" in log),
        "peer inference": ([*peer, "--role", "inference"], lambda log: "joined run" in log),
        "local": (
            ["echo_p2p.local", "--duration", "0", "--workdir", str(workdir / "local"), "--no-export"],
            lambda log: (workdir / "local" / "logs" / "bootstrap.log").exists(),
        ),
    }


def start_bootstrap(workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    """A bootstrap of this tree keeping a signed run record; (process, join address, record file)."""
    from echo_p2p.local_keys import make_run_record

    record, owner = make_run_record(workdir / "owner", RUN_ID, 1, "tiny", "count", "async")
    maddrs = workdir / "bootstrap.maddrs"
    args = ["-m", "echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs)]
    proc = subprocess.Popen(
        [sys.executable, *args, "--run-record", str(record)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    _wait(maddrs.exists, 60)
    if not maddrs.exists():
        stop(proc)
        raise RuntimeError("the benchmark's bootstrap did not start")
    return proc, f"{RUN_ID}:{owner}@{maddrs.read_text().split()[0]}", record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", metavar="DIR", default=None, help="another tree to measure side by side")
    parser.add_argument("--only", nargs="+", default=None, help="these entry points only")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "startup.json"))
    args = parser.parse_args()
    trees = {"after": ROOT} if args.before is None else {"before": Path(args.before).resolve(), "after": ROOT}
    samples: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        workdir = Path(tmp)
        boot, join, record = start_bootstrap(workdir)
        try:
            names = [n for n in entries(join, record, workdir) if args.only is None or n in args.only]
            for i in range(args.repeats):
                for name in names:
                    for label, tree in trees.items():  # taking turns: the load falls on both alike
                        run_dir = Path(tempfile.mkdtemp(dir=workdir))
                        argv, ready = entries(join, record, run_dir)[name]
                        result = run_entry(tree, argv, ready, run_dir)
                        samples.setdefault(name, {}).setdefault(label, []).append(result)
                        print(f"[{i + 1}/{args.repeats}] {name:<15} {label:<6} {result}", file=sys.stderr)
        finally:
            stop(boot)
    results = {
        name: {label: summarize(runs) for label, runs in by_tree.items()} for name, by_tree in samples.items()
    }
    print_table(results, list(trees))
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average_at_end": os.getloadavg(),
        "repeats": args.repeats,
        "trees": {label: _commit(tree) for label, tree in trees.items()},  # commits, not paths
        "results": results,
        "samples": samples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


def _commit(tree: Path) -> str:
    """The tree's commit (``-dirty``: with uncommitted edits), as ``git describe`` says it."""
    r = subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return r.stdout.strip() or "unknown"


def summarize(runs: list[dict]) -> dict:
    return {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "import_s": statistics.median(r["import_s"] for r in runs),
        "modules": int(statistics.median(r["modules"] for r in runs)),
        "max_rss_mb": statistics.median(r["max_rss_mb"] for r in runs),
        **{f"{h}_imported": any(h in r["heavy"] for r in runs) for h in HEAVY},
    }


def print_table(results: dict, labels: list[str]) -> None:
    """One row per entry point; each figure once per tree (before, after)."""
    figures = {"wall_s": "wall s", "import_s": "import s", "modules": "modules", "max_rss_mb": "RSS MB"}
    figures["torch_imported"] = "torch"
    cols = [(what, label) for what in figures for label in labels]
    print(f"{'entry point':<16}" + "".join(f"{figures[what] + ' ' + label:>16}" for what, label in cols))
    for name, by_tree in results.items():
        print(f"{name:<16}" + "".join(f"{_cell(by_tree[label][what]):>16}" for what, label in cols))


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
