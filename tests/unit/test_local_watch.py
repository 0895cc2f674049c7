"""The local swarm's watch loop ends a run when its duration is over, not at the next status line."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from echo_p2p.local import LocalSwarmConfig, _watch_loop


def test_the_duration_ends_the_run_between_two_status_lines(tmp_path):
    config = LocalSwarmConfig(duration=1.0, status_period=30.0)
    swarm = SimpleNamespace(
        config=config, workdir=tmp_path, stop_event=threading.Event(), dead_children=lambda: []
    )
    t0 = time.monotonic()
    assert _watch_loop(swarm, lambda: "status") == 0
    assert time.monotonic() - t0 < 10  # was 30: the first check after the duration came a status period later
