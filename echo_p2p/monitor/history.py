"""What a running monitor remembers between reads: a bounded time series and the alerts' timers.

Owned here: ``Tracker``. ``observe(status)`` appends one sample (time, newest version, reward, held-out
accuracy and reward, rollouts consumed, peers) to a ring of ``history_size`` samples and returns the ``alerts.Timers`` of this read: since
when the newest version has been the newest, and since when each trainer has had an empty buffer without
consuming anything. ``newest_at(t)`` is the newest version seen by time ``t`` (peers' lag is measured
against it); ``since(t)`` serves ``/api/history``; ``versions_per_minute`` the run header. It
remembers at most one timer per trainer listed in the status (bounded by ``MonitorConfig.max_peers``).
Thread-safe: the poller writes, the web server reads. Callers: ``monitor.status``, ``monitor.poller``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from echo_p2p.monitor.alerts import Timers
from echo_p2p.monitor.config import MonitorConfig

#: Seconds of history behind ``versions_per_minute``.
RATE_WINDOW = 300.0


class Tracker:
    def __init__(self, config: MonitorConfig | None = None):
        self.config = config or MonitorConfig()
        self.samples: deque[dict[str, Any]] = deque(maxlen=self.config.history_size)
        self._seen: deque[int | None] = deque(
            maxlen=self.config.history_size
        )  # newest version by each sample
        self.watching_since: float | None = None
        self._version: int | None = None
        self._version_since: float | None = None
        self._starved: dict[str, tuple[float, int | None]] = {}  # trainer -> (since, rollouts consumed then)
        self._lock = threading.Lock()

    def observe(self, status: dict[str, Any]) -> Timers:
        now = float(status["time"])
        summary = status["summary"]
        with self._lock:
            if self.watching_since is None:
                self.watching_since = now
            newest = summary["newest_version"]
            if newest is not None and (self._version is None or newest > self._version):
                self._version, self._version_since = newest, now
            self._update_starved(status, now)
            self._seen.append(self._version)
            self.samples.append(
                {
                    "time": now,
                    "version": newest,
                    "reward": summary["reward"],
                    "eval_accuracy": summary.get("eval_accuracy"),
                    "eval_reward": summary.get("eval_reward"),
                    "rollouts_consumed": summary["rollouts_consumed"],
                    "rollouts_per_second": summary["rollouts_per_second"],
                    "trainers": summary["trainers"],
                    "inference": summary["inference"],
                }
            )
            return Timers(
                now=now,
                watching_since=self.watching_since,
                version_since=self._version_since,
                starved_since={peer: since for peer, (since, _) in self._starved.items()},
            )

    def _update_starved(self, status: dict[str, Any], now: float) -> None:
        """A trainer is starved while it ingests pushes (async), its buffer is empty and the number of rollouts
        it consumed does not move; any of these changing restarts its clock."""
        seen = set()
        for row in status["peers"]:
            if row["role"] != "trainer" or row["state"] != "running" or row["trusted"] is False:
                continue
            if row["accepts_rollouts"] is not True or row["buffered_groups"] != 0:
                continue
            peer, consumed = row["peer_id"], row["rollouts_consumed"]
            seen.add(peer)
            since = self._starved.get(peer)
            if since is None or since[1] != consumed:
                self._starved[peer] = (now, consumed)
        for peer in set(self._starved) - seen:
            del self._starved[peer]

    def versions_per_minute(self, window: float = RATE_WINDOW) -> float | None:
        """New policy versions per minute over the last ``window`` seconds (None: under 10 s of data)."""
        with self._lock:
            points = [(s["time"], s["version"]) for s in self.samples if s["version"] is not None]
        if not points:
            return None
        t1, v1 = points[-1]
        first = next(((t, v) for t, v in points if t >= t1 - window), None)
        if first is None or t1 - first[0] < 10.0:
            return None
        return round(max(0, v1 - first[1]) * 60.0 / (t1 - first[0]), 2)

    def newest_at(self, t: float) -> int | None:
        """The newest policy version seen by time ``t``; None when no sample is that old. Looks back from the
        newest sample, so it costs the number of reads since ``t`` (a record is at most minutes old)."""
        with self._lock:
            for i in range(len(self.samples) - 1, -1, -1):
                if self.samples[i]["time"] <= t:
                    return self._seen[i]
        return None

    def since(self, after: float, limit: int) -> list[dict[str, Any]]:
        """The samples newer than ``after`` (the newest ``limit`` of them), oldest first."""
        with self._lock:
            out = [dict(s) for s in self.samples if s["time"] > after]
        return out[-limit:] if limit > 0 else []
