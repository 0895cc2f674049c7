"""Progress of policy-version downloads for people: a bar on a terminal, a log line now and then elsewhere.

CLI layer only (progress bars live in the CLI, never in roles or transports): the peer CLI hands a ``WeightsProgress`` to the
inference peer, which passes it to its weight fetcher as the progress callback. The figures themselves are
in the peer's metrics either way.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

logger = logging.getLogger("echo_p2p.progress")


class WeightsProgress:
    """Callback for ``WeightFetcher(on_progress=...)``: one bar (or a few log lines) per fetched version."""

    def __init__(self, stream: Any = None, log_every: float = 2.0, min_bytes: int = 1 << 20):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_every = log_every
        self.min_bytes = min_bytes  # versions smaller than this arrive too fast to be worth a display
        self._bar = None
        self._version: int | None = None
        self._last_log = 0.0

    def __call__(self, p) -> None:
        if p.bytes_total < self.min_bytes:
            return
        if p.version != self._version:
            self._close()
            self._version = p.version
            self._last_log = 0.0
            if self.tty:
                from tqdm import tqdm

                self._bar = tqdm(
                    total=p.bytes_total,
                    unit="B",
                    unit_scale=True,
                    file=self.stream,
                    desc=f"policy v{p.version}",
                    leave=False,
                )
        if self._bar is not None:
            self._bar.n = p.bytes_done
            self._bar.set_postfix(providers=p.providers, refresh=False)
            self._bar.refresh()
        elif time.monotonic() - self._last_log >= self.log_every or p.bytes_done >= p.bytes_total:
            self._last_log = time.monotonic()
            logger.info(
                "fetching policy version %d: %.1f/%.1f MiB (%d/%d chunks) from %d provider(s)",
                p.version,
                p.bytes_done / 2**20,
                p.bytes_total / 2**20,
                p.chunks_done,
                p.chunks_total,
                p.providers,
            )
        if p.bytes_done >= p.bytes_total:
            self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
