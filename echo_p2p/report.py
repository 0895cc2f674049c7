"""What a finished (or running) local run did: a summary of the metrics files and a reward-versus-time PNG.

Owned here: reading the per-step lines that trainers (``trainer-*.jsonl``) and the co-located baseline
(``colocated-*.jsonl``) write through ``echo_p2p.metrics``, turning them into ``RunSummary`` (steps,
versions, reward at the start and the end, rollouts consumed, dropped and refused, trainer idle share,
rollouts per second, staleness, the held-out evaluation's first and last figures from the ``"event":
"eval"`` lines; and where the run's final policy was exported, which the caller says), the one-line
progress of the live view, and ``plot_reward``.
Callers: ``echo_p2p.local`` (live view and end of run) and the benchmarks. No torch, no hivemind;
matplotlib is imported only by ``plot_reward``, with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from echo_p2p.metrics import read_metrics

#: Steps in a reward mean (the live view, the summary and the plot's smoothed line).
WINDOW = 10


def step_lines(metrics_dir: Path, role: str = "trainer") -> dict[str, list[dict[str, Any]]]:
    """Per-step lines of every ``<role>-*.jsonl`` in ``metrics_dir``, by file stem, each sorted by time."""
    out: dict[str, list[dict[str, Any]]] = {}
    if not metrics_dir.exists():
        return out
    for path in sorted(metrics_dir.glob(f"{role}-*.jsonl")):
        lines = [x for x in read_metrics(str(path)) if "step" in x and "reward_mean" in x]
        if lines:
            out[path.stem] = sorted(lines, key=lambda x: x["time"])
    return out


def eval_lines(metrics_dir: Path, kind: str | None) -> list[dict[str, Any]]:
    """The held-out evaluation lines (``"event": "eval"``, ``train.evaluation``) of the trainers (``kind``
    "swarm") or of the co-located run, by time."""
    role = "colocated" if kind == "colocated" else "trainer"
    lines = [
        x
        for path in sorted(metrics_dir.glob(f"{role}-*.jsonl"))
        for x in read_metrics(str(path))
        if x.get("event") == "eval" and isinstance(x.get("eval_accuracy"), int | float)
    ]
    return sorted(lines, key=lambda x: x["time"])


@dataclass
class Runs:
    """The per-step lines of a run folder, read once: the trainers' (``kind`` "swarm") or else the
    co-located run's (``kind`` "colocated"); ``lines`` maps a metrics file stem to its lines."""

    kind: str | None
    lines: dict[str, list[dict[str, Any]]]

    @classmethod
    def load(cls, metrics_dir: Path) -> Runs:
        trainers = step_lines(metrics_dir, "trainer")
        if trainers:
            return cls("swarm", trainers)
        colocated = step_lines(metrics_dir, "colocated")
        return cls("colocated" if colocated else None, colocated)

    def merged(self) -> list[dict[str, Any]]:
        """Every step line of every file, by time."""
        return sorted((x for lines in self.lines.values() for x in lines), key=lambda x: x["time"])


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def moving_mean(values: list[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def mean_staleness(*hists: dict[str, int] | None) -> float | None:
    """Mean over one or more ``staleness_hist`` (``{"versions behind": groups}``); None when all are empty."""
    total = n = 0
    for hist in hists:
        for behind, groups in (hist or {}).items():
            total += int(behind) * groups
            n += groups
    return total / n if n else None


@dataclass
class RunSummary:
    """The figures a newcomer wants at the end of a run (all trainers together, or the co-located run)."""

    kind: str  # "swarm" or "colocated"
    steps: int = 0
    versions: int = 0
    seconds_training: float = 0.0  # first to last step line
    reward_first: float = float("nan")  # mean of the first WINDOW steps
    reward_final: float = float("nan")  # mean of the last WINDOW steps
    # the trainers' mean re-scored reward of the last groups they received, the ones they do not train on
    # included (all-equal rewards, repeats of accepted content): the trained groups' mean reads low once most
    # groups are right, since those are the ones left out
    received_reward_final: float | None = None
    rollouts_consumed: int = 0
    rollouts_per_second: float = 0.0
    dropped_stale: int = 0
    refused_at_ingest: dict[str, int] = field(default_factory=dict)
    trainer_idle_fraction: float | None = None
    mean_staleness: float | None = None
    groups_sampled: int | None = None  # by the inference peers (swarm)
    stale_fraction: float | None = None  # (dropped as stale + refused too_stale) / sampled
    samplers_paced_fraction: float | None = None  # share of their time the samplers waited for a grant
    first_step_seconds: float | None = None  # from launch to the first training step
    model_path: str | None = None  # the final policy as a model directory (python -m echo_p2p.export)
    model_version: int | None = None
    model_dtype: str | None = None
    evaluations: int = 0  # held-out evaluations (train.evaluation)
    eval_version_first: int | None = None
    eval_version_final: int | None = None
    eval_accuracy_first: float | None = None  # greedy, exact answers on the held-out prompts
    eval_accuracy_final: float | None = None
    eval_reward_first: float | None = None  # mean reward sampled at the run's temperature
    eval_reward_final: float | None = None
    eval_seconds: float | None = None  # what the evaluations took together

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [
            f"steps {self.steps}, policy versions {self.versions}, "
            f"{self.seconds_training:.0f} s from the first to the last step",
            f"reward {self.reward_first:.3f} (first {WINDOW} steps) -> {self.reward_final:.3f} (last {WINDOW})",
            f"rollout groups consumed {self.rollouts_consumed} ({self.rollouts_per_second:.1f}/s)",
        ]
        if self.received_reward_final is not None:
            out.insert(
                2,
                f"reward of every group received at the end {self.received_reward_final:.3f} (re-scored; the "
                "groups trained on leave out those whose completions all score the same)",
            )
        if self.kind == "swarm":
            refused = sum(self.refused_at_ingest.values())
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.refused_at_ingest.items())) or "none"
            out.append(
                f"dropped from the buffer as stale {self.dropped_stale}, refused at ingest {refused} ({reasons})"
            )
            idle = "-" if self.trainer_idle_fraction is None else f"{100 * self.trainer_idle_fraction:.0f}%"
            stale = "-" if self.mean_staleness is None else f"{self.mean_staleness:.2f}"
            out.append(f"trainer idle {idle}, mean staleness of consumed rollouts {stale} versions")
            if self.groups_sampled:
                waste = "-" if self.stale_fraction is None else f"{100 * self.stale_fraction:.0f}%"
                paced = (
                    "-"
                    if self.samplers_paced_fraction is None
                    else f"{100 * self.samplers_paced_fraction:.0f}%"
                )
                out.append(
                    f"rollout groups sampled {self.groups_sampled}, {waste} of them too stale to train on; "
                    f"samplers waited for the trainers' grants {paced} of the time"
                )
        if self.evaluations:
            out.append(
                f"held-out accuracy {self.eval_accuracy_first:.3f} (version {self.eval_version_first}) -> "
                f"{self.eval_accuracy_final:.3f} (version {self.eval_version_final}), reward "
                f"{self.eval_reward_first:.3f} -> {self.eval_reward_final:.3f}; {self.evaluations} evaluations, "
                f"{self.eval_seconds:.1f} s in all"
            )
        if self.first_step_seconds is not None:
            out.append(f"first training step {self.first_step_seconds:.1f} s after launch")
        if self.model_path is not None:
            out.append(model_line(self.model_path, self.model_version, self.model_dtype))
        return out

    def add_evaluations(self, lines: list[dict[str, Any]]) -> None:
        """Fill the ``eval_*`` fields from the evaluation lines (``eval_lines``), if any."""
        if not lines:
            return
        first, last = lines[0], lines[-1]
        self.evaluations = len(lines)
        self.eval_version_first, self.eval_version_final = first.get("eval_version"), last.get("eval_version")
        self.eval_accuracy_first, self.eval_accuracy_final = first["eval_accuracy"], last["eval_accuracy"]
        self.eval_reward_first, self.eval_reward_final = first.get("eval_reward"), last.get("eval_reward")
        self.eval_seconds = round(sum(float(x.get("eval_seconds") or 0.0) for x in lines), 3)


def model_line(path: str, version: int | None, dtype: str | None) -> str:
    """The summary's line about the exported final policy."""
    return (
        f"final policy (version {'-' if version is None else version}, {dtype or '-'}) in {path}: "
        "AutoModelForCausalLM.from_pretrained and vLLM load it"
    )


def summarize(runs: Runs) -> RunSummary | None:
    """Summary of the trainers' lines, else of the co-located run's, else None (nothing trained yet)."""
    if runs.kind == "swarm":
        return _summarize_swarm(runs)
    if runs.kind == "colocated":
        return _summarize_colocated(next(iter(runs.lines.values())))
    return None


def _samplers(metrics_dir: Path) -> tuple[int | None, float | None]:
    """Groups the inference peers sampled, and the share of their time they waited for a grant."""
    sampled, paced, seconds = 0, 0.0, 0.0
    found = False
    for path in sorted(metrics_dir.glob("inference-*.jsonl")):
        lines = [x for x in read_metrics(str(path)) if "groups_sampled" in x]
        if not lines:
            continue
        found = True
        sampled += int(lines[-1]["groups_sampled"])
        paced += float(lines[-1].get("seconds_paced") or 0.0)
        seconds += max(0.0, lines[-1]["time"] - lines[0]["time"])
    if not found:
        return None, None
    return sampled, (paced / seconds if seconds > 0 else None)


def _summarize_swarm(runs: Runs) -> RunSummary:
    merged = runs.merged()
    rewards = [x["reward_mean"] for x in merged]
    lasts = [lines[-1] for lines in runs.lines.values()]
    refused: dict[str, int] = {}
    for last in lasts:
        for reason, n in (last.get("rejected") or {}).items():
            refused[reason] = refused.get(reason, 0) + int(n)
    idles = [last["idle_fraction"] for last in lasts if last.get("idle_fraction") is not None]
    received = [
        float(x["received_reward_mean"])
        for lines in runs.lines.values()
        if (x := next((y for y in reversed(lines) if y.get("received_reward_mean") is not None), None))
    ]
    return RunSummary(
        kind="swarm",
        steps=sum(int(lines[-1].get("steps", len(lines))) for lines in runs.lines.values()),
        versions=max(int(x.get("version") or 0) for x in merged),
        seconds_training=merged[-1]["time"] - merged[0]["time"],
        reward_first=mean(rewards[:WINDOW]),
        reward_final=mean(rewards[-WINDOW:]),
        received_reward_final=round(mean(received), 4) if received else None,
        rollouts_consumed=sum(int(last.get("rollouts_consumed", 0)) for last in lasts),
        rollouts_per_second=_rate(runs.lines),
        dropped_stale=sum(int(last.get("dropped_stale", 0)) for last in lasts),
        refused_at_ingest=refused,
        trainer_idle_fraction=mean(idles) if idles else None,
        mean_staleness=mean_staleness(*(x.get("staleness_hist") for x in merged)),
    )


def _rate(trainers: dict[str, list[dict[str, Any]]]) -> float:
    """Rollout groups consumed per second by all trainers, between each one's first and last step."""
    total = 0.0
    for lines in trainers.values():
        if len(lines) >= 2 and lines[-1]["time"] > lines[0]["time"]:
            consumed = int(lines[-1].get("rollouts_consumed", 0)) - int(lines[0].get("rollouts_consumed", 0))
            total += consumed / (lines[-1]["time"] - lines[0]["time"])
    return total


def _summarize_colocated(lines: list[dict[str, Any]]) -> RunSummary:
    rewards = [x["reward_mean"] for x in lines]
    seconds = lines[-1]["time"] - lines[0]["time"]
    consumed = int(lines[-1].get("rollouts_consumed", 0))
    sampling = sum(x.get("sampling_s", 0.0) + x.get("scoring_s", 0.0) for x in lines)
    step_time = sum(x.get("step_s", 0.0) for x in lines)
    return RunSummary(
        kind="colocated",
        steps=len(lines),
        versions=int(lines[-1].get("version") or 0),
        seconds_training=seconds,
        reward_first=mean(rewards[:WINDOW]),
        reward_final=mean(rewards[-WINDOW:]),
        rollouts_consumed=consumed,
        rollouts_per_second=(consumed - int(lines[0].get("rollouts_consumed", 0))) / seconds
        if seconds > 0
        else 0.0,
        # the learner waits while the same process samples and scores
        trainer_idle_fraction=sampling / step_time if step_time > 0 else None,
        mean_staleness=0.0,
    )


def progress_line(runs: Runs) -> str | None:
    """The live view's training line: step, version, reward, rollouts/s, staleness, drops, idle."""
    if runs.kind is None:
        return None
    merged = runs.merged()
    newest = merged[-1]
    recent = merged[-WINDOW:]
    line = (
        f"{'training' if runs.kind == 'swarm' else 'co-located'}: step {len(merged)}, "
        f"version {newest.get('version')}, reward {mean([x['reward_mean'] for x in recent]):.3f} "
        f"(first {min(WINDOW, len(merged))} steps: {mean([x['reward_mean'] for x in merged[:WINDOW]]):.3f}), "
        f"{_rate(runs.lines):.1f} rollouts/s"
    )
    stale = mean_staleness(newest.get("staleness_hist"))
    if stale is not None:
        line += f", staleness {stale:.1f}"
    if runs.kind == "swarm":
        lasts = [lines[-1] for lines in runs.lines.values()]
        consumed = sum(int(last.get("rollouts_consumed", 0)) for last in lasts)
        dropped = sum(int(last.get("dropped_stale", 0)) for last in lasts)
        idle = mean([last.get("idle_fraction", 0.0) for last in lasts])
        line += f", consumed {consumed}, dropped stale {dropped}, trainer idle {100 * idle:.0f}%"
    return line


def reward_reached(runs: Runs, target: float) -> bool:
    """True once the mean reward of the last WINDOW steps (all trainers together) is at least ``target``."""
    merged = runs.merged()
    return len(merged) >= WINDOW and mean([x["reward_mean"] for x in merged[-WINDOW:]]) >= target


def reward_axis(values: list[float]) -> tuple[float, float]:
    """The plot's reward range: [0, 1] (the built-in tasks' range) widened to every value, 2% margin on each
    side. Rewards may have any scale (a plug-in task's weighted sum may be negative or above 1)."""
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = min([0.0, *finite]), max([1.0, *finite])
    margin = 0.02 * (hi - lo)
    return lo - margin, hi + margin


def plot_reward(
    curves: dict[str, list[tuple[float, float]]],
    path: Path,
    title: str,
    xlabel: str = "seconds since start",
    evaluations: dict[str, list[tuple[float, float]]] | None = None,
) -> Path:
    """Write a PNG of reward against time (or steps): each curve's points and its WINDOW-step moving mean.

    ``curves`` maps a label to ``[(x, reward), ...]`` in x order; ``evaluations`` (the held-out figures,
    same form) are drawn as they are, a marked line each.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    evaluations = evaluations or {}
    everything = [*curves.values(), *evaluations.values()]
    ax.set_ylim(*reward_axis([y for points in everything for _, y in points]))
    for i, (label, points) in enumerate(evaluations.items(), start=len(curves)):
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, linestyle="--", color=f"C{i}", label=label)
    for i, (label, points) in enumerate(curves.items()):
        if not points:
            continue
        color = f"C{i}"
        xs, ys = zip(*points, strict=True)
        ax.scatter(xs, ys, s=6, alpha=0.25, color=color)
        ax.plot(xs, moving_mean(list(ys)), color=color, label=f"{label} ({WINDOW}-step mean)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean reward of the step's rollouts" if not evaluations else "reward / held-out figures")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def reward_curves(runs: Runs, start: float | None = None) -> dict[str, list[tuple[float, float]]]:
    """``{label: [(seconds since start, reward)]}`` for every metrics file of ``runs``; ``start`` defaults
    to the earliest step line."""
    if not runs.lines:
        return {}
    t0 = start if start is not None else min(lines[0]["time"] for lines in runs.lines.values())
    return {
        name[:22]: [(x["time"] - t0, float(x["reward_mean"])) for x in lines]
        for name, lines in runs.lines.items()
    }


def write_report(
    metrics_dir: Path,
    out_dir: Path,
    title: str,
    start: float | None = None,
    model: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``summary.json`` and ``reward.png`` into ``out_dir``; returns what was written (paths, summary).
    ``model``: the exported final policy (``path``, ``version``, ``dtype``), named in the summary."""
    runs = Runs.load(metrics_dir)
    summary = summarize(runs)
    if summary is not None and model is not None:
        summary.model_path, summary.model_version = model["path"], model.get("version")
        summary.model_dtype = model.get("dtype")
    if summary is not None and summary.kind == "swarm":
        summary.groups_sampled, summary.samplers_paced_fraction = _samplers(metrics_dir)
        if summary.groups_sampled:
            stale = summary.dropped_stale + summary.refused_at_ingest.get("too_stale", 0)
            summary.stale_fraction = stale / summary.groups_sampled
    if summary is not None and start is not None and runs.lines:
        first = min(lines[0]["time"] for lines in runs.lines.values())  # each file's lines are by time
        summary.first_step_seconds = max(0.0, first - start)
    evals = eval_lines(metrics_dir, runs.kind)
    if summary is not None:
        summary.add_evaluations(evals)
    written: dict[str, Any] = {"summary": summary.as_dict() if summary else None}
    (out_dir / "summary.json").write_text(json.dumps(written["summary"], indent=2) + "\n")
    written["summary_path"] = str(out_dir / "summary.json")
    curves = reward_curves(runs, start)
    if curves:
        t0 = start if start is not None else min(lines[0]["time"] for lines in runs.lines.values())
        held_out = {
            f"held-out {name} ({key})": [
                (x["time"] - t0, float(x[key])) for x in evals if x.get(key) is not None
            ]
            for key, name in (("eval_accuracy", "accuracy, greedy"), ("eval_reward", "reward, sampled"))
        }
        written["plot_path"] = str(
            plot_reward(
                curves, out_dir / "reward.png", title, evaluations={k: v for k, v in held_out.items() if v}
            )
        )
    return written


def print_report(
    workdir: Path, title: str, started_at: float, model: Mapping[str, Any] | None = None
) -> None:
    """Write the report of the run whose metrics are in ``workdir/metrics`` (``write_report``) and print its
    summary; an error is printed, never raised (a report must not hide the run's own exit code)."""
    workdir = Path(workdir)
    try:
        written = write_report(workdir / "metrics", workdir, title, start=started_at, model=model)
    except Exception as exc:
        print(f"could not write the report: {exc}", file=sys.stderr)
        return
    if written["summary"] is None:
        print("summary: no training step was taken", flush=True)
        if model is not None:
            print(f"  {model_line(model['path'], model.get('version'), model.get('dtype'))}", flush=True)
        return
    summary = RunSummary(**written["summary"])
    print("summary:", flush=True)
    for line in summary.lines():
        print(f"  {line}", flush=True)
    print(f"  metrics {written['summary_path']}; plot {written.get('plot_path', '-')}", flush=True)
