"""What each process of a local run is doing while the run starts, read from the end of its log.

Owned here: ``phase`` (the last line an echo_p2p process logged, without its time, level, logger and
status prefix, and how long ago) and ``phases_block`` (one such line per process). A peer logs each step
of its start (joining, loading the model and the task, joined, waiting for the first policy version), so
the newest line is what it is doing now. Caller: ``echo_p2p.local``'s status loop, until the first training
step. Reads log files only; never fails on a log that is missing, empty or being written.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from pathlib import Path

#: ``HH:MM:SS [LEVEL] logger: [peer role vN] message`` (``echo_p2p.logs.FORMAT``; the prefix is optional).
LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) \[[A-Z]+\] [\w.]+: (?:\[[^\]]*\] )?(?P<message>.*)$")
#: Bytes read from the end of a log.
TAIL_BYTES = 8192
#: Characters of a message shown.
WIDTH = 90


def phase(log: Path, now: float | None = None) -> str:
    """The newest echo_p2p line of ``log`` with its age (``joined run 'x' in 6.1 s (3 s ago)``), or what
    an empty log means (the process is still importing its libraries)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "not started"
    for line in reversed(lines):
        match = LINE.match(line)
        if match:
            message = match["message"]
            if len(message) > WIDTH:
                message = message[: WIDTH - 1] + "…"
            return f"{message} ({_age(match, now)} s ago)"
    return "starting (importing its libraries)"


def _age(match: re.Match, now: float | None) -> int:
    """Seconds since the line's wall-clock time of day (local time, as the log writes it)."""
    t = time.localtime(now)
    of_day = t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec
    logged = int(match[1]) * 3600 + int(match[2]) * 60 + int(match[3])
    return (of_day - logged) % 86400


def phases_block(children: Iterable[tuple[str, Path]], now: float | None = None) -> str:
    """One line per ``(name, log)``: ``  trainer-0    loading the model and the task (4 s ago)``."""
    return "\n".join(f"  {name:<12} {phase(log, now)}" for name, log in children)
