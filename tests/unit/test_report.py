"""The end-of-run report: summary figures from metrics files, the live progress line and the reward PNG."""

from __future__ import annotations

import json
import math

import pytest

from echo_p2p.metrics import MetricsWriter
from echo_p2p.report import (
    WINDOW,
    Runs,
    mean_staleness,
    moving_mean,
    plot_reward,
    progress_line,
    reward_axis,
    reward_curves,
    reward_reached,
    summarize,
    write_report,
)


def write_trainer(
    metrics_dir, peer, steps, *, t0=1000.0, reward=lambda i: i / 100, rejected=None, received=None
):
    writer = MetricsWriter(str(metrics_dir), "trainer", peer)
    lines = []
    for i in range(steps):
        extra = {} if received is None else {"received_reward_mean": received(i)}
        line = writer.write(
            i + 1,
            step=i + 1,
            reward_mean=reward(i),
            staleness_hist={"0": 8, "2": 8},
            rollouts_consumed=16 * (i + 1),
            dropped_stale=3 * i,
            idle_fraction=0.25,
            rejected=rejected or {},
            **extra,
        )
        line["time"] = t0 + i  # one step a second, written back so the test controls time
        lines.append(line)
    path = metrics_dir / f"trainer-{peer}.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn": ')
    return lines


def test_swarm_summary_adds_up_trainers_and_reads_the_reward_rise(tmp_path):
    write_trainer(tmp_path, "a", 30, rejected={"too_stale": 5})
    write_trainer(tmp_path, "b", 20, t0=1000.5, rejected={"too_stale": 1, "bad_reward": 2})
    s = summarize(Runs.load(tmp_path))
    assert s.kind == "swarm"
    assert s.steps == 50 and s.versions == 30
    assert s.rollouts_consumed == 16 * 30 + 16 * 20
    assert s.dropped_stale == 3 * 29 + 3 * 19
    assert s.refused_at_ingest == {"too_stale": 6, "bad_reward": 2}
    assert s.rollouts_per_second == pytest.approx(16 + 16)  # each trainer 16 groups a second
    assert s.mean_staleness == pytest.approx(1.0)
    assert s.trainer_idle_fraction == pytest.approx(0.25)
    assert s.reward_first < 0.06 and s.reward_final > 0.2
    text = "\n".join(s.lines())
    assert "too_stale 6" in text and "reward 0.0" in text


def test_colocated_summary_and_idle_share(tmp_path):
    writer = MetricsWriter(str(tmp_path), "colocated", "base")
    for i in range(12):
        writer.write(
            i + 1,
            step=i,
            reward_mean=0.5,
            rollouts_consumed=16 * (i + 1),
            step_s=0.1,
            sampling_s=0.02,
            scoring_s=0.01,
        )
    s = summarize(Runs.load(tmp_path))
    assert s.kind == "colocated" and s.steps == 12 and s.rollouts_consumed == 192
    assert s.trainer_idle_fraction == pytest.approx(0.3)
    assert s.reward_final == pytest.approx(0.5)


def test_nothing_trained_gives_no_summary_and_no_plot(tmp_path):
    assert summarize(Runs.load(tmp_path / "missing")) is None
    written = write_report(tmp_path / "missing", tmp_path, "empty")
    assert written["summary"] is None and "plot_path" not in written
    assert json.loads((tmp_path / "summary.json").read_text()) is None


def test_progress_line_and_reward_target(tmp_path):
    assert progress_line(Runs.load(tmp_path)) is None
    write_trainer(tmp_path, "a", 25)
    line = progress_line(Runs.load(tmp_path))
    assert line.startswith("training: step 25, version 25")
    assert "staleness 1.0" in line and "16.0 rollouts/s" in line and "trainer idle 25%" in line
    assert reward_reached(Runs.load(tmp_path), 0.15)  # last ten: 0.15..0.24, mean 0.195
    assert not reward_reached(Runs.load(tmp_path), 0.2)


def test_report_writes_a_png_of_the_curves(tmp_path):
    write_trainer(tmp_path, "a", 30)
    written = write_report(tmp_path, tmp_path, "count on tiny")
    png = tmp_path / "reward.png"
    assert written["plot_path"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 30
    curves = reward_curves(Runs.load(tmp_path))
    (points,) = curves.values()
    assert points[0] == (0.0, 0.0) and points[-1] == (29.0, 0.29)


def test_plot_reward_accepts_several_curves(tmp_path):
    path = plot_reward({"a": [(0, 0.1), (1, 0.2)], "b": [(0.5, 0.3)], "empty": []}, tmp_path / "x.png", "t")
    assert path.exists() and path.read_bytes()[:4] == b"\x89PNG"


def test_the_reward_axis_shows_rewards_of_any_scale():
    assert reward_axis([0.1, 0.9]) == pytest.approx((-0.02, 1.02))  # the built-in tasks' [0, 1]
    assert reward_axis([]) == pytest.approx((-0.02, 1.02))
    lo, hi = reward_axis([-3.0, 0.5, 12.0, math.nan])  # a plug-in task's weighted sum: nothing cut off
    assert lo < -3.0 and hi > 12.0 and math.isfinite(lo) and math.isfinite(hi)


def test_helpers():
    assert moving_mean([1, 2, 3, 4], window=2) == [1, 1.5, 2.5, 3.5]
    assert (
        len(moving_mean(list(range(50)))) == 50
        and moving_mean(list(range(50)))[-1] == sum(range(40, 50)) / WINDOW
    )
    assert mean_staleness({"0": 1, "3": 1}) == 1.5
    assert mean_staleness({}) is None
    assert math.isnan(summarize.__globals__["mean"]([]))


def test_the_written_report_counts_what_the_samplers_made_and_how_much_came_too_stale(tmp_path):
    metrics, out = tmp_path / "metrics", tmp_path / "out"
    metrics.mkdir()
    out.mkdir()
    write_trainer(metrics, "t", 30, rejected={"too_stale": 13, "duplicate_content": 50})  # 87 dropped stale
    for peer, sampled, paced in (("i1", 600, 10.0), ("i2", 400, 30.0)):
        lines = [
            {"time": 1000.0, "groups_sampled": 0, "seconds_paced": 0.0},
            {"time": 1040.0, "groups_sampled": sampled, "seconds_paced": paced},
        ]
        (metrics / f"inference-{peer}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = write_report(metrics, out, "t", start=990.0)["summary"]
    assert summary["groups_sampled"] == 1000
    assert summary["stale_fraction"] == pytest.approx((87 + 13) / 1000)  # duplicates are not staleness
    assert summary["samplers_paced_fraction"] == pytest.approx(40 / 80)
    assert summary["first_step_seconds"] == pytest.approx(10.0)


def test_the_summary_names_the_exported_final_policy(tmp_path, capsys):
    from echo_p2p.report import print_report

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    write_trainer(metrics, "a", 12)
    model = {"path": str(tmp_path / "model"), "version": 12, "dtype": "bfloat16"}
    print_report(tmp_path, "count on tiny", 990.0, model)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["model_path"], summary["model_version"], summary["model_dtype"]) == (
        str(tmp_path / "model"),
        12,
        "bfloat16",
    )
    assert f"final policy (version 12, bfloat16) in {tmp_path / 'model'}" in capsys.readouterr().out
    assert write_report(metrics, tmp_path, "t")["summary"]["model_path"] is None


def test_the_held_out_evaluations_reach_the_summary_and_the_plot(tmp_path):
    write_trainer(tmp_path, "a", 30)
    path = tmp_path / "trainer-a.jsonl"
    evals = [
        {"time": 1000.0 + t, "version": v, "event": "eval", "eval_version": v, "eval_accuracy": acc}
        | {"eval_reward": reward, "eval_seconds": 0.25}
        for t, v, acc, reward in ((0, 0, 0.0, 0.02), (10, 10, 0.5, 0.4), (20, 20, 0.75, 0.6))
    ]
    with path.open("a") as f:  # after the torn line, as a later write would follow it
        f.write("\n" + "".join(json.dumps(x) + "\n" for x in evals))
    written = write_report(tmp_path, tmp_path, "count on tiny")
    s = written["summary"]
    assert s["steps"] == 30  # evaluation lines are not steps
    assert (s["evaluations"], s["eval_version_first"], s["eval_version_final"]) == (3, 0, 20)
    assert (s["eval_accuracy_first"], s["eval_accuracy_final"]) == (0.0, 0.75)
    assert (s["eval_reward_first"], s["eval_reward_final"], s["eval_seconds"]) == (0.02, 0.6, 0.75)
    text = "\n".join(summarize(Runs.load(tmp_path)).lines())
    assert "held-out" not in text  # summarize alone reads steps; write_report adds the evaluations
    from echo_p2p.report import RunSummary

    assert "held-out accuracy 0.000 (version 0) -> 0.750 (version 20)" in "\n".join(RunSummary(**s).lines())
    assert (tmp_path / "reward.png").stat().st_size > 5000


def test_the_reward_of_every_group_received_is_reported_beside_the_trained_groups_one(tmp_path):
    """Once most groups are right, the groups trained on are the ones with mistakes (all-equal groups are
    refused as no_signal or duplicate content): the summary also gives the trainers' received-groups reward."""
    write_trainer(tmp_path, "a", 30, reward=lambda i: 0.7, received=lambda i: 0.5 + i / 100)
    write_trainer(tmp_path, "b", 30, t0=1000.5, reward=lambda i: 0.7, received=lambda i: 0.9)
    s = summarize(Runs.load(tmp_path))
    assert s.received_reward_final == pytest.approx((0.79 + 0.9) / 2)
    assert "reward of every group received at the end 0.845" in "\n".join(s.lines())
    write_trainer(tmp_path, "a", 30)  # older trainers' lines carry no such figure: no line
    write_trainer(tmp_path, "b", 30)
    s = summarize(Runs.load(tmp_path))
    assert s.received_reward_final is None and "every group received" not in "\n".join(s.lines())
