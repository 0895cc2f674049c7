"""One log format for every echo_p2p process; status lines carry peer id, role and version; repeated lines
are rate-limited with counts.

Callers: the CLI modules, once, before anything else logs (``setup_logging``); any module whose line can
repeat many times a second (refused rollouts, versions applied or published) logs it through a
``RateLimitedLog``. hivemind keeps its own handler for its own loggers; we only set their level so that a
peer's output stays readable.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable

FORMAT = "%(asctime)s [%(levelname)s] %(name)s: %(message)s"
#: Environment variable of per-logger levels applied over a process's own, e.g.
#: ``ECHO_LOG_LEVELS=hivemind.averaging=DEBUG,echo_p2p.transport=DEBUG``: what one component does, in detail,
#: without the rest of a peer's DEBUG output (hivemind's matchmaking logs only at DEBUG). Read by
#: ``setup_logging``; the processes a peer forks (hivemind's averagers) inherit the levels.
LEVELS_ENV = "ECHO_LOG_LEVELS"
LEVEL_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Seconds between two lines about policy versions published or applied (a tiny-model trainer makes ~4 a second).
VERSION_LINE_PERIOD = 5.0


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger("echo_p2p")
    if not any(getattr(h, "_echo", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._echo = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)
    # hivemind reads its level from the environment in every process it starts (the DHT's child too)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING" if level != "DEBUG" else "INFO")
    # hivemind is chatty at INFO about internals (identity generation, averaging rounds)
    logging.getLogger("hivemind").setLevel(max(logging.getLevelName(level), logging.WARNING))
    # bitsandbytes warns at import on CPUs with AVX512-BF16 that an optional 4-bit kernel package is missing
    # (it falls back to its own kernel): shown at DEBUG only
    if level != "DEBUG":
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    levels, refused = parse_log_levels(os.environ.get(LEVELS_ENV, ""))
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)
    for entry in refused:
        logging.getLogger("echo_p2p.logs").warning(
            "%s: ignoring %r (want LOGGER=LEVEL, LEVEL one of %s)", LEVELS_ENV, entry, ", ".join(LEVEL_NAMES)
        )


def parse_log_levels(spec: str) -> tuple[dict[str, str], list[str]]:
    """``"a.b=DEBUG, c=info"`` -> ``({"a.b": "DEBUG", "c": "INFO"}, [])``, and the entries that are not
    ``LOGGER=LEVEL`` with a known level, refused (second item). Empty entries are skipped."""
    levels: dict[str, str] = {}
    refused: list[str] = []
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, sep, value = entry.partition("=")
        name, value = name.strip(), value.strip().upper()
        if not sep or not name or value not in LEVEL_NAMES:
            refused.append(entry)
        else:
            levels[name] = value
    return levels, refused


def status_prefix(peer_id: str, role: str, version: int | None) -> str:
    """``[<short peer id> <role> v<version>]`` — the start of every status line."""
    return f"[{peer_id[-8:]} {role} v{'-' if version is None else version}]"


class RateLimitedLog:
    """At most one line per key every ``period`` seconds, each saying how many it stands for.

    The first event of a key is logged at once; later ones are counted, and the first event after
    ``period`` has passed since the key's last line is logged with `` (x N in the last S s)``: N events of
    that key since its previous line (this one included), over S seconds. Events of the last window are
    told with the key's next line, if any (``count`` words it): a count that must be exact belongs in the metrics (the callers
    count there too). Thread-safe.
    """

    def __init__(
        self,
        logger: logging.Logger,
        period: float = 10.0,
        count: str = "x {n} in the last {seconds:.0f} s",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger = logger
        self.period = period
        self.count = count  # how a line tells the events it stands for
        self._clock = clock
        self._last: dict[Hashable, float] = {}  # key -> time of its last line
        self._count: dict[Hashable, int] = {}  # key -> events since that line, not yet told
        self._lock = threading.Lock()

    def log(self, level: int, key: Hashable, message: str, *args: object) -> bool:
        """Count one event of ``key``; log ``message % args`` if the key's line is due. True if logged."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            n = self._count.get(key, 0) + 1
            last = self._last.get(key)
            if last is not None and now - last < self.period:
                self._count[key] = n
                return False
            self._last[key], self._count[key] = now, 0
        if last is not None and n > 1:
            told = self.count.format(n=n, seconds=now - last).replace("%", "%%")
            message = f"{message} ({told})"
        self.logger.log(level, message, *args)
        return True

    def info(self, key: Hashable, message: str, *args: object) -> bool:
        return self.log(logging.INFO, key, message, *args)

    def warning(self, key: Hashable, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, message, *args)
