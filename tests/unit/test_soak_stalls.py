"""The chaos soak's stall measure (``benchmarks/soak.py``): a stall that several faults overlap is charged
the time after the first fault began that no fault explains, not only what followed the last one. The
hour of 2026-12-07 stood still 350 s while three faults came and went, and the old measure said 2.1 s."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def load_soak(monkeypatch):
    spec = importlib.util.spec_from_file_location("soak_benchmark", SOAK)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_time_between_overlapping_faults_is_not_explained_by_them(monkeypatch):
    soak = load_soak(monkeypatch)
    # that hour's stall, 1,590-1,940 s, and its three faults' [start, back]
    assert soak.uncovered(1590, 1940, [(1634, 1666), (1726, 1746), (1884, 1938)]) == 200
    assert soak.uncovered(100, 130, [(95, 120)]) == 10  # one fault: what followed its peer's return
    assert soak.uncovered(100, 118, [(95, 120)]) == 0  # ended before the peer was back
    assert soak.uncovered(100, 130, [(105, None)]) == 0  # a peer that never came back covers the rest
    assert soak.uncovered(100, 130, [(90, 110), (105, 125)]) == 5  # overlapping windows count once
