"""What a stranger costs a run: training speed with and without each attack, side by side in one run.

Each arm runs the README's local swarm (``python -m echo_p2p.local``: a bootstrap with the owner's run record,
one trainer, two inference peers that join with the run's address, tiny model, ``count`` task, async) for
``--duration`` seconds; in every arm but ``baseline`` a stranger (``benchmarks/attacker.py``) joins the same
run from its join address as soon as the bootstrap is up and attacks until the end. The attacker runs
at nice 19: on a real network it has a machine of its own, and what is measured here is what its messages
cost the run, not its share of these two cores. Reported per arm: steps
in the budget, steps per minute between the trainer's first and last step and its ratio to ``baseline``,
rollouts consumed per second, the reward of the last 10 steps, the senders the trainers banned (the poisoner;
any other is an honest peer banned by mistake), what the inference peers' weight fetches did about slow
providers (``fetch_slow``: chunks hedged, providers dropped and banned, summed over the peers; in the JSON),
what the attacker saw (the trainers'
verdicts on what it sent, or the DHT's), and where the inference peers' time went (``inference_time``,
summed over the peers: sampling, loading versions into the engine, waiting for weights, fetching by phase,
failed fetches, policy-record reads; a second table) and how long the peers' directory reads took
(``directory_reads``: per role and kind of record, reads, seconds and the slowest; a third table).

The ``idle`` arm is the control for the attacker's own processes (a DHT node, p2pd, a Python loop) on these
two shared cores: it joins and sends nothing; ``x idle`` is each arm's rate over the idle arms' mean. Run as
root, the attacker's processes also share a cgroup whose CPU quota is ``--attacker-cpu`` cores (0.25 by
default; ``attacker_cpu_limit`` in the JSON: the quota and how often it was throttled), so that what they take
of these cores is bounded alike in every arm, as on a machine of its own; without root, nice 19 only.

Run: ``python benchmarks/attacks.py [--duration 60] [--arms baseline,idle,poison,oversized,heavy,flood,ghost,
idle,baseline] [--out PATH]`` (``slow-late``, ``slow-drip``, ``slow-never``: a weight provider that serves valid
chunks slowly; ``follow``, their control: the same provider serving at full speed, so that ``x follow`` is
what the slowness costs apart from a follower's own processes on these cores) (about 1.5 minutes per arm; ``x base`` is to the mean of the baseline arms). Writes JSON to ``--out``. The machine is shared and noisy:
compare arms of the same run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Keys the sybil attacker gets before its arm starts (``--sybil-keys``; it makes no more).
SYBIL_KEYS = 1000
#: Where an inference peer's time went (its metrics line; summed over the arm's peers): sampling, putting
#: versions into its engine, waiting for newer weights, for a trainer's grant, for room at a trainer.
INFERENCE_TIME = (
    *("seconds_sampling", "seconds_loading_weights", "seconds_waiting_for_weights", "seconds_paced"),
    "seconds_waiting_for_room",
)
#: Its weight fetcher's totals (``FetchStats``), and its phases' (``phases_total``, as ``phase_*``).
FETCH_TIME = (
    *("versions_applied", "fetch_seconds_total", "failed_seconds_total", "record_reads"),
    "record_read_seconds_total",
)
#: Where this machine's cgroup CPU controller is mounted: v1's own hierarchy, or the v2 unified one.
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
ARMS = (
    *("baseline", "idle", "poison", "oversized", "heavy", "flood", "ghost", "sybil", "tarpit"),
    *("slow-late", "slow-drip", "slow-never", "follow"),
)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def wait_for_files(paths: list[Path], proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def stop(proc: subprocess.Popen | None, grace: float = 20.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class CpuLimit:
    """A cgroup of its own whose processes together get at most ``cores`` of CPU time (CFS quota), for the
    attacker: on a real network it has a machine of its own, and on these shared cores what its messages
    cost the run must be told apart from what its processes take from the run's CPU (issue 29).

    ``join`` (a ``preexec_fn``) moves the new process into the group before it runs the attacker; every
    process it starts (its DHT child, p2pd) inherits the group. ``figures`` reads the controller's throttling
    counters; ``remove`` deletes the group once its processes are gone. ``reason`` says why there is no group
    (not root, no writable CPU controller): the attacker then runs at nice 19 only, as before."""

    def __init__(self, cores: float, name: str) -> None:
        self.cores = cores
        self.path: Path | None = None
        self.procs_file = "cgroup.procs"
        self.reason = ""
        period = 100_000  # microseconds, the kernel's default CFS period
        quota = max(1_000, int(cores * period))
        try:
            if CGROUP_V1_CPU.is_dir() and (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
                self.path = CGROUP_V1_CPU / name
                self.path.mkdir()
                (self.path / "cpu.cfs_period_us").write_text(str(period))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            elif "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text().split():
                self.path = CGROUP_V2 / name
                self.path.mkdir()
                (self.path / "cpu.max").write_text(f"{quota} {period}")
            else:
                self.reason = "no cgroup CPU controller on this machine"
        except OSError as exc:
            self.reason = f"cannot make a cgroup ({exc.strerror or exc}; run as root)"
            self.remove()

    def join(self) -> None:
        if self.path is not None:
            (self.path / self.procs_file).write_text(str(os.getpid()))

    def figures(self) -> dict[str, Any]:
        """The group's CFS counters (periods, those throttled, seconds throttled), or the reason for none."""
        if self.path is None:
            return {"cores": None, "reason": self.reason}
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip()
        )
        throttled_s = int(stat.get("throttled_time", 0)) / 1e9 or int(stat.get("throttled_usec", 0)) / 1e6
        out: dict[str, Any] = {"cores": self.cores, "periods": int(stat.get("nr_periods", 0))}
        out.update(throttled_periods=int(stat.get("nr_throttled", 0)), throttled_s=round(throttled_s, 1))
        if "usage_usec" in stat:
            out["cpu_s"] = round(int(stat["usage_usec"]) / 1e6, 1)
        return out

    def remove(self) -> None:
        """Delete the group (its processes stopped first); a group still busy is retried for 10 s."""
        if self.path is None:
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                self.path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"could not remove the cgroup {self.path}", file=sys.stderr)
                    break
                time.sleep(0.2)
        self.path = None


def run_arm(
    arm: str,
    duration: float,
    workroot: Path,
    index: int,
    attacker_cpu: float = 0.0,
    sybil_keys: int = SYBIL_KEYS,
) -> dict[str, Any]:
    from echo_p2p.metrics import read_metrics
    from echo_p2p.net.run_record import read_file

    name = f"{index}-{arm}"
    workdir = workroot / name
    key_dir = workroot / "keys"  # made once, before the first arm that uses them
    if arm in ("sybil", "ghost") and not key_dir.exists():  # made on its own machine: here, before the run
        sys.path.insert(0, str(HERE))
        from attacker import make_keys

        make_keys(key_dir, sybil_keys)
    local = subprocess.Popen(
        [sys.executable, "-m", "echo_p2p.local", "--duration", str(duration), "--workdir", str(workdir)],
        cwd=str(ROOT),
        stdout=open(workroot / f"{name}-local.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    attacker = None
    report = workroot / f"{name}-attacker.json"
    limit = CpuLimit(attacker_cpu, f"echo-attacker-{os.getpid()}-{index}") if attacker_cpu > 0 else None
    cpu_limit: dict[str, Any] = {"cores": None, "reason": "not asked for (--attacker-cpu 0)"}
    try:
        files = [workdir / "bootstrap.maddrs", workdir / "run-record.bin"]
        if not wait_for_files(files, local, 120):
            raise RuntimeError(f"{arm}: the local swarm did not start (see {workroot / f'{name}-local.log'})")
        if arm != "baseline":
            record, _, _ = read_file(workdir / "run-record.bin")
            maddr = (workdir / "bootstrap.maddrs").read_text().split()[0]
            join = f"{record.run_id}:{record.owner_peer_id()}@{maddr}"
            attacker = subprocess.Popen(
                ["nice", "-n", "19", sys.executable, str(HERE / "attacker.py"), "--attack", arm]
                + ["--join", join, "--duration", str(duration), "--report", str(report)]
                + (["--key-dir", str(key_dir)] if arm in ("sybil", "ghost") else []),
                cwd=str(ROOT),
                stdout=open(workroot / f"{name}-attacker.log", "wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=limit.join if limit is not None else None,
            )
        local.wait(timeout=duration + 180)
    finally:
        stop(local)
        stop(attacker)
        if limit is not None:
            cpu_limit = limit.figures()
            limit.remove()
    summary = json.loads((workdir / "summary.json").read_text())
    seen = json.loads(report.read_text())["seen"] if report.exists() else {}
    banned = 0  # senders the trainers banned at the end: the attacker (poison) or an honest peer (a bug)
    for path in (workdir / "metrics").glob("trainer-*.jsonl"):
        lines = [x for x in read_metrics(str(path)) if "senders" in x]
        banned += lines[-1]["senders"].get("banned", 0) if lines else 0
    fetch_slow: dict[
        str, int
    ] = {}  # the inference peers' weight fetches: slow providers hedged, dropped, banned
    inference_time: dict[str, float] = {}
    for path in (workdir / "metrics").glob("inference-*.jsonl"):
        lines = [x for x in read_metrics(str(path)) if "weights" in x]
        weights = lines[-1]["weights"] if lines else {}
        for key, count in (weights.get("slow") or {}).items():
            fetch_slow[key] = fetch_slow.get(key, 0) + count
        if weights.get("banned"):
            fetch_slow["providers_banned"] = fetch_slow.get("providers_banned", 0) + len(weights["banned"])
        for key in INFERENCE_TIME:  # where the peer's time went, summed over the peers
            value = lines[-1].get(key) if lines else None
            if isinstance(value, (int, float)):
                inference_time[key] = round(inference_time.get(key, 0.0) + value, 3)
        for key in FETCH_TIME:
            value = weights.get(key)
            if isinstance(value, (int, float)):
                inference_time[f"fetch_{key}"] = round(inference_time.get(f"fetch_{key}", 0.0) + value, 3)
        for phase, seconds in (weights.get("phases_total") or {}).items():
            inference_time[f"phase_{phase}"] = round(inference_time.get(f"phase_{phase}", 0.0) + seconds, 3)
    # the peers' directory reads (their own and their fetchers'), per role and kind of record: reads, seconds
    # in all, the slowest (a slow DHT node a read waits on shows here)
    directory_reads: dict[str, dict[str, dict[str, float]]] = {}
    for path in (workdir / "metrics").glob("*.jsonl"):
        role = path.stem.split("-")[0]
        lines = [x for x in read_metrics(str(path)) if "directory_reads" in x]
        if not lines:
            continue
        last = lines[-1]
        for figures in (last["directory_reads"], (last.get("weights") or {}).get("directory_reads") or {}):
            for kind, f in figures.items():
                into = directory_reads.setdefault(role, {}).setdefault(
                    kind, {"reads": 0, "seconds": 0.0, "slowest": 0.0}
                )
                into["reads"] += f["reads"]
                into["seconds"] = round(into["seconds"] + f["seconds"], 3)
                into["slowest"] = max(into["slowest"], f["slowest"])
    span = summary.get("seconds_training") or 0.0
    return {
        "arm": arm,
        "steps": summary["steps"],
        "steps_per_minute": round(60 * (summary["steps"] - 1) / span, 1) if span > 0 else 0.0,
        "rollouts_per_second": round(summary.get("rollouts_per_second") or 0.0, 1),
        "reward_final": summary.get("reward_final"),
        "refused_at_ingest": summary.get("refused_at_ingest"),
        "senders_banned": banned,
        "fetch_slow": fetch_slow,
        "inference_time": inference_time,
        "directory_reads": directory_reads,
        "attacker_saw": seen,
        "attacker_cpu_limit": cpu_limit if arm != "baseline" else None,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument(
        "--arms",
        default=",".join((*ARMS, "idle", "baseline")),
        help="in this order; a baseline first and last brackets the machine's drift (ratios use their mean)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "attacks.json"))
    p.add_argument(
        "--attacker-cpu",
        type=float,
        default=0.25,
        help="cores the attacker's processes get together, from a cgroup of their own (root; 0: no limit, "
        "nice 19 only): what its messages cost the run, apart from what its processes take of these cores",
    )
    p.add_argument(
        "--sybil-keys", type=int, default=SYBIL_KEYS, help="keys the sybil arm makes before its run"
    )
    p.add_argument(
        "--workdir", default="", help="keep every arm's logs and metrics here (default: a temporary one)"
    )
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        p.error(f"unknown arms {sorted(unknown)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="echo-attacks-") as scratch:
        tmp = Path(args.workdir or scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        for index, arm in enumerate(arms):
            rows.append(run_arm(arm, args.duration, tmp, index, args.attacker_cpu, args.sybil_keys))
            print(f"{arm}: {rows[-1]}", flush=True)

    def mean_rate(arm: str) -> float | None:
        rates = [r["steps_per_minute"] for r in rows if r["arm"] == arm]
        return sum(rates) / len(rates) if rates and sum(rates) > 0 else None

    base, idle, follow = mean_rate("baseline"), mean_rate("idle"), mean_rate("follow")
    print(
        f"\n{'arm':<10} {'steps':>6} {'steps/min':>10} {'x base':>7} {'x idle':>7} {'x follow':>8} {'roll/s':>7}"
        f" {'reward':>7} {'bans':>4}  attacker saw"
    )
    for r in rows:
        ratio = r["steps_per_minute"] / base if base else None
        # x idle: against a stranger that joins and sends nothing (its own processes share these cores):
        # what the attack's messages cost, apart from what running an attacker here costs
        ratio_idle = r["steps_per_minute"] / idle if idle and r["arm"] != "baseline" else None
        r["ratio_to_baseline"] = round(ratio, 3) if ratio is not None else None
        r["ratio_to_idle"] = round(ratio_idle, 3) if ratio_idle is not None else None
        # x follow (slow providers): against an honest provider that follows the run the same way
        ratio_follow = r["steps_per_minute"] / follow if follow and r["arm"].startswith("slow-") else None
        r["ratio_to_follow"] = round(ratio_follow, 3) if ratio_follow is not None else None
        seen = ", ".join(f"{k} {v}" for k, v in sorted(r["attacker_saw"].items(), key=lambda kv: -kv[1])[:4])
        print(
            f"{r['arm']:<10} {r['steps']:>6} {r['steps_per_minute']:>10.1f} "
            f"{'-' if ratio is None else format(ratio, '.2f'):>7} "
            f"{'-' if ratio_idle is None else format(ratio_idle, '.2f'):>7} "
            f"{'-' if ratio_follow is None else format(ratio_follow, '.2f'):>8} {r['rollouts_per_second']:>7.1f} "
            f"{'-' if r['reward_final'] is None else format(r['reward_final'], '.3f'):>7} "
            f"{r['senders_banned']:>4}  {seen}"
        )
    # where the inference peers' time went (seconds summed over the peers of the arm; versions applied)
    cols = ("versions_applied", "seconds_sampling", "seconds_loading_weights", "seconds_waiting_for_weights")
    cols += ("fetch_fetch_seconds_total", "fetch_failed_seconds_total", "fetch_record_read_seconds_total")
    heads = ("versions", "sampling", "loading", "wait_w", "fetching", "failed", "reads")
    print(f"\n{'arm':<10} " + " ".join(f"{h:>9}" for h in heads) + "  fetch phases (s)")
    for r in rows:
        t = r["inference_time"]
        values = [t.get("fetch_versions_applied" if c == "versions_applied" else c) for c in cols]
        phases = ", ".join(f"{k[6:]} {v:.1f}" for k, v in t.items() if k.startswith("phase_"))
        print(f"{r['arm']:<10} " + " ".join(f"{fmt(v):>9}" for v in values) + f"  {phases}")
    print(f"\n{'arm':<10} directory reads per role and kind: reads, seconds in all / slowest")
    for r in rows:
        parts = [
            f"{role} {kind} {f['reads']} {f['seconds']:.1f}/{f['slowest']:.2f}"
            for role, kinds in sorted(r["directory_reads"].items())
            for kind, f in sorted(kinds.items())
        ]
        print(f"{r['arm']:<10} " + "; ".join(parts))
    out = {
        "benchmark": "attacks",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "duration_s": args.duration,
        "attacker_cpu": args.attacker_cpu,
        "sybil_keys": args.sybil_keys,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
