import io
import logging
from dataclasses import dataclass

from echo_p2p.progress import WeightsProgress


@dataclass
class P:
    version: int
    chunks_done: int
    chunks_total: int
    bytes_done: int
    bytes_total: int
    providers: int


def test_progress_logs_when_not_a_terminal_and_ignores_tiny_versions(caplog):
    report = WeightsProgress(stream=io.StringIO(), log_every=0.0, min_bytes=1000)
    with caplog.at_level(logging.INFO, logger="echo_p2p.progress"):
        report(P(1, 1, 1, 10, 10, 1))  # below min_bytes: silent
        report(P(2, 1, 4, 2**20, 4 * 2**20, 3))
        report(P(2, 4, 4, 4 * 2**20, 4 * 2**20, 3))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "fetching policy version 2: 1.0/4.0 MiB (1/4 chunks) from 3 provider(s)",
        "fetching policy version 2: 4.0/4.0 MiB (4/4 chunks) from 3 provider(s)",
    ]


def test_progress_draws_a_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    report = WeightsProgress(stream=out, min_bytes=1)
    report(P(7, 1, 2, 50, 100, 2))
    assert report._bar is not None and "policy v7" in out.getvalue()
    report(P(7, 2, 2, 100, 100, 2))
    assert report._bar is None  # closed when complete
