"""Benchmark of the training modes at the same wall-clock budget: co-located, decoupled sync, async.

Each arm runs the real entry point as a subprocess, one arm after another, for ``--budget`` seconds:

* ``colocated`` / ``colocated-2t``: ``python -m echo_p2p.colocated --duration S --threads 1|2`` (sampling and
  training take turns in one process; per-step JSONL ``colocated-*.jsonl``); 1 thread is one process per
  core like each decoupled peer, 2 threads is the whole machine;
* ``standalone``: ``python -m echo_p2p.colocated --standalone 8 --threads 1``: a trainer with no network and
  no sampling, training round after round on 8 steps' worth of groups sampled before the clock starts: the
  ceiling of what a decoupled trainer can consume (its reward means nothing). The decoupled arms are shown
  against it (rollouts/s, and seconds per update: the swarm's tax on the trainer);
* ``sync`` / ``async``: ``python -m echo_p2p.local --mode sync|async --duration S --inference N`` (a
  bootstrap, 1 trainer, N inference peers on 127.0.0.1, one torch thread each;
  trainer metrics ``trainer-*.jsonl`` per step, inference metrics ``inference-*.jsonl`` every ~10 s).

Every arm gets the same task (``--task``, ``--task-option``), model (tiny), G and prompts per step
(``--prompts-per-step``, default 16) and GRPO hyper-parameters. Reported per arm:

* rollouts (groups) consumed per second, between the first and the last training step, and its ratio to
  ``colocated``;
* trainer idle fraction: co-located, the sampling + scoring share of the step time; decoupled, the seconds
  the trainer waited for rollouts between its first and last step, over that span (``idle_s_total``);
* inference idle fraction: co-located, the training share of the step time; decoupled, the share of each
  inference peer's work time spent waiting for weights, for room in a trainer's buffer or for its grant
  (pacing), averaged over peers. In sync mode the peers sample only when the trainer asks, so that share misses the time spent
  waiting for a request; the ``inf. not sampling`` column (1 - sampling seconds / work seconds) counts every
  second not spent sampling, including that wait. Inference metrics are written every ~10 s, so the last
  few seconds of a run are missing from them;
* versions per minute, reward at the end of the budget (mean of the last 10 steps) and at an equal number
  of updates ``n``, the smallest step count all arms reached (mean over steps [n-10, n));
* for the co-located arms, the Amdahl ceiling of decoupling: (sampling + training) / training, the most a
  trainer that never waits and trains as fast as the co-located process could consume relative to it.

Times on the reward curve count from the launch of the arm's command, so they include start-up. The
``first step`` column shows how long each arm took to start training.

Run: ``python benchmarks/modes.py [--budget 60] [--arms colocated,colocated-2t,standalone,sync,async] [--inference 1]
[--prompts-per-step 16] [--out PATH]`` (about 5.5 min with the defaults). Writes JSON to ``--out`` and a
reward-vs-time PNG next to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARMS = ("colocated", "colocated-2t", "standalone", "sync", "async")
#: arms whose metrics are the co-located process's (``colocated-*.jsonl``, one version per step)
IN_PROCESS = ("colocated", "colocated-2t", "standalone")
#: steps' worth of groups the standalone trainer samples once and trains on round after round
STANDALONE_POOL = 8
WINDOW = 10  # steps in a reward mean
TRAINERS = 1
INFERENCE_PEERS = 1  # on 2 cores: one for the trainer, one for the inference peer


def run_arm(
    arm: str, budget: float, workdir: Path, extra_wait: float, setup: dict[str, Any]
) -> tuple[float, float, int, Path]:
    """Run one arm's command; returns (launch time, seconds it ran, exit code, metrics dir)."""
    metrics_dir = workdir / "metrics"
    options = [arg for option in setup["task_options"] for arg in ("--task-option", option)]
    if arm in IN_PROCESS:
        threads = "2" if arm == "colocated-2t" else "1"
        cmd = [
            sys.executable,
            "-m",
            "echo_p2p.colocated",
            *("--task", setup["task"], "--duration", str(budget), "--metrics-dir", str(metrics_dir)),
            *("--threads", threads, "--steps", "100000", *options),
            *("--prompts-per-step", str(setup["prompts_per_step"])),
        ]
        if arm == "standalone":
            cmd += ["--standalone", str(STANDALONE_POOL), "--name", "standalone"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "echo_p2p.local",
            *("--mode", arm, "--duration", str(budget), "--workdir", str(workdir)),
            *("--status-period", "10", "--task", setup["task"], *options),
            *("--inference", str(setup["inference_peers"])),
        ]
        peer_args = f"--prompts-per-step {setup['prompts_per_step']} {setup.get('peer_args') or ''}".strip()
        cmd.append(f"--peer-args={peer_args}")
    log = workdir / f"{arm}.log"
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[{arm}] {' '.join(cmd[1:])}", flush=True)
    launched = time.time()
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            code = proc.wait(timeout=budget + extra_wait)
        except subprocess.TimeoutExpired:
            print(f"[{arm}] still running {budget + extra_wait:.0f} s after launch: SIGTERM", flush=True)
            os.killpg(proc.pid, signal.SIGTERM)  # its own group (start_new_session): only what it started
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    seconds = time.monotonic() - t0
    print(f"[{arm}] exited with code {code} after {seconds:.1f} s (log {log})", flush=True)
    return launched, seconds, code, metrics_dir


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def steps_of(arm: str, metrics_dir: Path) -> list[dict[str, Any]]:
    """Per-step lines of the arm's trainers (or co-located process), oldest first."""
    from echo_p2p.report import step_lines

    runs = step_lines(metrics_dir, "colocated" if arm in IN_PROCESS else "trainer")
    return sorted((x for lines in runs.values() for x in lines), key=lambda x: (x["time"], x["step"]))


def inference_figures(metrics_dir: Path) -> dict[str, Any]:
    """Idle shares of the inference peers from their last metrics line each."""
    from echo_p2p.metrics import read_metrics

    waiting, not_sampling, groups = [], [], 0
    for path in sorted(metrics_dir.glob("inference-*.jsonl")) if metrics_dir.exists() else []:
        lines = [x for x in read_metrics(str(path)) if "groups_sampled" in x]
        if not lines:
            continue
        last = lines[-1]
        groups += int(last.get("groups_sampled") or 0)
        rps = last.get("rollouts_per_second") or 0.0
        # work seconds since the peer's main loop started: groups / (groups per second of work time)
        work_s = last["groups_sampled"] / rps if rps and last["groups_sampled"] else None
        if work_s is None and len(lines) > 1:
            work_s = lines[-1]["time"] - lines[0]["time"]
        if not work_s:
            continue
        wait = sum(  # for weights, for an outbox slot, for a trainer's grant (pacing)
            last.get(key) or 0.0
            for key in ("seconds_waiting_for_weights", "seconds_waiting_for_room", "seconds_paced")
        )
        waiting.append(min(1.0, wait / work_s))
        tps = last.get("tokens_per_second") or 0.0
        sampling_s = last["tokens_sampled"] / tps if tps else 0.0
        not_sampling.append(max(0.0, 1.0 - sampling_s / work_s))
    return {
        "inference_idle_fraction": mean(waiting),
        "inference_not_sampling_fraction": mean(not_sampling),
        "inference_peers_reporting": len(waiting),
        "groups_sampled": groups,
    }


def summarize(arm: str, launched: float, seconds: float, code: int, metrics_dir: Path) -> dict[str, Any]:
    steps = steps_of(arm, metrics_dir)
    out: dict[str, Any] = {"arm": arm, "exit_code": code, "seconds": round(seconds, 2), "steps": len(steps)}
    if arm in IN_PROCESS:
        for x in steps:
            x["version"] = x["step"] + 1  # one version per step
    curve = [[round(x["time"] - launched, 3), x["step"], x["version"], x["reward_mean"]] for x in steps]
    out["curve"] = curve  # [seconds since launch, step, version, reward_mean]
    if not steps:
        return out
    first, last = steps[0], steps[-1]
    span = last["time"] - first["time"]
    out["first_step_s"] = round(first["time"] - launched, 2)
    out["last_step_s"] = round(last["time"] - launched, 2)
    out["rollouts_consumed"] = last["rollouts_consumed"]
    # between the first and the last step line: the first step's own rollouts are before the span
    out["rollouts_per_s"] = (
        (last["rollouts_consumed"] - first["rollouts_consumed"]) / span if span > 0 else None
    )
    out["versions_per_min"] = 60 * (last["version"] - first["version"]) / span if span > 0 else None
    # the standalone trainer relearns the same groups: its reward says nothing about learning
    out["reward_end"] = mean([x["reward_mean"] for x in steps[-WINDOW:]]) if arm != "standalone" else None
    if arm == "standalone":
        out["trainer_idle_fraction"] = 0.0
        out["median_update_s"] = statistics.median(x["training_s"] for x in steps)
    elif arm.startswith("colocated"):
        sampling = sum(x["sampling_s"] + x["scoring_s"] for x in steps)
        training = sum(x["training_s"] for x in steps)
        busy = sampling + training
        out["trainer_idle_fraction"] = sampling / busy if busy else None
        out["inference_idle_fraction"] = training / busy if busy else None
        out["inference_not_sampling_fraction"] = out["inference_idle_fraction"]
        # Amdahl: a decoupled trainer that never waits and trains as fast as this process does consumes
        # (sampling + training) / training times the rollouts per second
        out["decoupling_ceiling"] = busy / training if training else None
        out["median_sampling_s"] = statistics.median(x["sampling_s"] + x["scoring_s"] for x in steps)
        out["median_training_s"] = statistics.median(x["training_s"] for x in steps)
    else:
        out["trainer_idle_fraction_since_start"] = last.get("idle_fraction")
        # steady state: idle seconds between the first and the last step over that span
        if span > 0 and "idle_s_total" in last:
            out["trainer_idle_fraction"] = (last["idle_s_total"] - first["idle_s_total"]) / span
        else:
            out["trainer_idle_fraction"] = last.get("idle_fraction")
        out["median_update_s"] = statistics.median(x["step_update_s"] for x in steps if "step_update_s" in x)
        out["dropped_stale"] = last.get("dropped_stale", 0)
        out.update(inference_figures(metrics_dir))
    return out


def add_ratios(arms: list[dict[str, Any]], reference: str, key: str, out_key: str) -> None:
    """``arm[out_key] = arm[key] / the reference arm's`` for every arm that has ``key``, when the reference
    arm ran and has it."""
    ref = next((r for r in arms if r["arm"] == reference), None)
    if not ref or not ref.get(key):
        return
    for r in arms:
        if r.get(key) is not None:
            r[out_key] = r[key] / ref[key]


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(results: dict[str, Any]) -> None:
    cfg = results["config"]
    options = " ".join(cfg["task_options"]) or "defaults"
    print(
        f"\nconfiguration: {cfg['cores']} cores, budget {cfg['budget_s']:.0f} s per arm, task {cfg['task']} "
        f"({options}), model {cfg['model']}, G={cfg['group_size']} x {cfg['prompts_per_step']} prompts per step; "
        f"decoupled: {cfg['trainers']} trainer + {cfg['inference_peers']} inference peers, 1 torch thread each"
        f"{' (' + cfg['peer_args'] + ')' if cfg['peer_args'] else ''}; co-located: 1 process, 1 or 2 threads (-2t)"
    )
    n = results["equal_updates"]
    head = (
        f"{'arm':<13} {'steps':>5} {'1st step':>8} {'rollouts/s':>10} {'vs co-loc.':>10} {'trainer idle':>12} "
        f"{'inf. idle':>9} {'inf. not sampling':>17} {'versions/min':>12} {'reward@end':>10} "
        f"{f'reward@{n} upd':>13}"
    )
    print(head)
    print("-" * len(head))
    for r in results["arms"]:
        print(
            f"{r['arm']:<13} {r['steps']:>5} {fmt(r.get('first_step_s'), '7.1f') + 's':>8} "
            f"{fmt(r.get('rollouts_per_s'), '.2f'):>10} {fmt(r.get('rollouts_vs_colocated'), '.2f') + 'x':>10} "
            f"{fmt(r.get('trainer_idle_fraction'), '.1%'):>12} "
            f"{fmt(r.get('inference_idle_fraction'), '.1%'):>9} "
            f"{fmt(r.get('inference_not_sampling_fraction'), '.1%'):>17} "
            f"{fmt(r.get('versions_per_min'), '.1f'):>12} {fmt(r.get('reward_end'), '.3f'):>10} "
            f"{fmt(r.get('reward_equal_updates'), '.3f'):>13}"
        )
    for r in results["arms"]:
        if r.get("decoupling_ceiling"):
            print(
                f"\n{r['arm']}: median step = {r['median_sampling_s']:.3f} s sampling+scoring + "
                f"{r['median_training_s']:.3f} s training; a decoupled trainer that never waits can consume at most "
                f"{r['decoupling_ceiling']:.2f}x its rollouts/s (Amdahl: (sampling + training) / training)"
            )
        if r.get("median_update_s"):
            print(f"{r['arm']}: median trainer update {r['median_update_s']:.3f} s")
    for r in results["arms"]:
        if r["arm"] in ("sync", "async") and r.get("vs_standalone") is not None:
            print(
                f"{r['arm']} vs the standalone trainer (the decoupling ceiling): rollouts/s "
                f"{r['vs_standalone']:.2f}x, seconds per update {fmt(r.get('update_vs_standalone'), '.2f')}x "
                "(swarm tax)"
            )
    print(
        "\nrollouts/s and versions/min: between the first and the last step. trainer idle: co-located = "
        "sampling+scoring share of step time; decoupled = seconds the trainer waited for rollouts between its first "
        "and last step over that span.\n"
        "inf. idle: co-located = training share; decoupled = share of each inference peer's work time spent "
        "waiting for weights, buffer room or a grant (mean over peers; in sync mode this misses the wait for "
        "sample requests).\ninf. not sampling: 1 - sampling seconds / work seconds (includes that wait). "
        f"reward@end: mean of the last {WINDOW} steps; reward@{n} upd: mean over steps [{max(0, n - WINDOW)}, {n})."
    )


def plot(results: dict[str, Any], path: Path) -> None:
    from echo_p2p.report import plot_reward

    cfg = results["config"]
    curves = {r["arm"]: [(c[0], c[3]) for c in r.get("curve") or []] for r in results["arms"]}
    title = f"{cfg['task']}, {cfg['prompts_per_step']} prompts/step, {cfg['budget_s']:.0f} s per arm"
    plot_reward(curves, path, title, xlabel="seconds since launch")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=60.0, help="wall-clock seconds per arm (default 60)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--task", default="count", help="task of every arm (default count)")
    p.add_argument(
        "--task-option", action="append", default=[], metavar="KEY=VALUE", help="task option of every arm"
    )
    p.add_argument(
        "--inference", type=int, default=INFERENCE_PEERS, help="inference peers of the decoupled arms"
    )
    p.add_argument("--peer-args", default="", help="more flags for the decoupled arms' peers")
    p.add_argument(
        "--prompts-per-step",
        type=int,
        default=None,
        help="rollout groups per GRPO step in every arm (default: the trainer's, 16)",
    )
    p.add_argument("--out", default=str(HERE / "results" / "modes.json"), help="JSON results file")
    p.add_argument(
        "--workdir", default=None, help="keep logs and metrics here (default: a temp dir, removed)"
    )
    p.add_argument(
        "--extra-wait", type=float, default=90.0, help="seconds past the budget before an arm is stopped"
    )
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms or args.budget <= 0:
        p.error(f"--arms must be a subset of {','.join(ARMS)} and --budget > 0 (got {unknown or arms})")

    sys.path.insert(0, str(ROOT))
    from echo_p2p.config import RunSettings, TrainerSection

    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="echo-modes-"))
    started = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "modes",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "budget_s": args.budget,
            "arms": arms,
            "task": args.task,
            "task_options": args.task_option,
            "peer_args": args.peer_args,
            "model": "tiny",
            "group_size": RunSettings.model_fields["group_size"].default,
            "prompts_per_step": args.prompts_per_step
            or TrainerSection.model_fields["prompts_per_step"].default,
            "trainers": TRAINERS,
            "inference_peers": args.inference,
            "colocated_threads": {"colocated": 1, "colocated-2t": 2, "standalone": 1},
        },
        "arms": [],
    }
    try:
        for arm in arms:
            launched, seconds, code, metrics_dir = run_arm(
                arm, args.budget, base / arm, args.extra_wait, results["config"]
            )
            summary = summarize(arm, launched, seconds, code, metrics_dir)
            results["arms"].append(summary)
            print(
                f"[{arm}] {summary['steps']} steps, reward at the end {fmt(summary.get('reward_end'), '.3f')}",
                flush=True,
            )
    finally:
        if not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
    counts = [r["steps"] for r in results["arms"]]
    n = min(counts) if counts else 0
    results["equal_updates"] = n
    for r in results["arms"]:
        rewards = [c[3] for c in r.get("curve", [])]
        # the standalone trainer relearns the same groups: its reward says nothing about learning
        usable = n and r["arm"] != "standalone"
        r["reward_equal_updates"] = mean(rewards[max(0, n - WINDOW) : n]) if usable else None
    add_ratios(results["arms"], "colocated", "rollouts_per_s", "rollouts_vs_colocated")
    add_ratios(results["arms"], "standalone", "rollouts_per_s", "vs_standalone")
    add_ratios(results["arms"], "standalone", "median_update_s", "update_vs_standalone")
    results["elapsed_s"] = round(time.perf_counter() - started, 1)
    print_table(results)
    print(f"\ntotal {results['elapsed_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
