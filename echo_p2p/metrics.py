"""Per-peer metrics as JSON lines: ``<metrics_dir>/<role>-<peer_id>.jsonl``, one object per line.

Owned here: the file naming and the common fields (``time``, ``role``, ``peer_id``, ``version``); each role
adds its own figures. Writes are appended and flushed line by line, so a killed peer loses at most the
line being written. Callers: the peers. No torch, no hivemind.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class MetricsWriter:
    """Appends one JSON object per call; a no-op when no directory was configured."""

    def __init__(self, metrics_dir: str | None, role: str, peer_id: str):
        self.role = role
        self.peer_id = peer_id
        self.path: str | None = None
        if metrics_dir:
            os.makedirs(metrics_dir, exist_ok=True)
            self.path = os.path.join(metrics_dir, f"{role}-{peer_id}.jsonl")

    def write(self, version: int | None, **figures: Any) -> dict[str, Any] | None:
        if self.path is None:
            return None
        line = {
            "time": time.time(),
            "role": self.role,
            "peer_id": self.peer_id,
            "version": version,
            **figures,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
            f.flush()
        return line


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Read a metrics file back, skipping a torn last line."""
    out = []
    with open(path) as f:
        for raw in f:
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue
    return out


def peak_rss_mib() -> float | None:
    """This process's peak resident memory so far (MiB), or None where ``resource`` is missing."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes on macOS, KiB elsewhere
