"""A peer's watchdog: named progress signals with deadlines, a stall report, and a way out for a supervisor.

Owned here: ``WatchdogConfig`` (the ``watchdog`` section of a peer's config), ``Watchdog`` (signals, the
checker thread, the stall and recovery log lines, the thread dump) and ``exit_stalled``. A signal is a name,
a deadline in seconds and a *due* predicate: progress is only expected while it can happen (a trainer steps
only when it holds a batch; an inference peer applies a newer version only once one is known). The owner
calls ``beat(name)`` on each bit of progress (one assignment: cheap on hot paths). The checker thread finds
the signals that are due and had no progress for longer than their deadline: it logs one ERROR line per
signal and a dump of every thread's stack (what each waits on) and of the child processes (a DHT child
frozen shows as ``stopped``), keeps the set of stalled names (the peer announces them, ``PeerRecord.stalled``)
and calls ``on_stall`` (with ``restart_on_stall`` the peer exits ``cli.EXIT_STALLED``, for its supervisor to
start it again: ``exit_stalled``). Progress after a stall logs ``recovered``. Callers: ``roles.base`` and the role classes.
Standard library only (psutil for the child processes, if present); the clock is injectable for tests.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.cli import EXIT_STALLED

logger = logging.getLogger(__name__)

#: Bounds of a signal name and of how many stalled names a peer announces (``PeerRecord.stalled``).
MAX_SIGNAL_NAME = 32
MAX_STALLED = 8
#: Bounds of a thread dump: threads listed, innermost frames per thread, characters in all.
DUMP_THREADS = 64
DUMP_FRAMES = 12
DUMP_CHARS = 24_000
#: The checker looks every ``min(deadline) / 4`` seconds, within these bounds.
CHECK_PERIOD_MIN = 0.05
CHECK_PERIOD_MAX = 5.0


class WatchdogConfig(BaseModel):
    """The ``watchdog`` section of a peer's config (``docs/reliability.md``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(default=True, description="Watch the peer's progress signals for stalls")
    dht_deadline: float = Field(
        default=45.0,
        gt=0,
        le=3600,
        description="Seconds within which the peer's record must be stored again and its heartbeat's DHT "
        "calls must come back (at least two heartbeats); 45 s: a frozen DHT is reported within a minute",
    )
    work_deadline: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Seconds within which the role's work must make progress while it can: a trainer "
        "holding a batch steps, an inference peer holding a policy samples, a newer version is applied",
    )
    restart_on_stall: bool = Field(
        default=False,
        description=f"On a stall, after the report, leave (at most exit_grace s) and exit {EXIT_STALLED} "
        "so that a supervisor restarts the peer; off: keep running and announce the stall",
    )
    exit_grace: float = Field(
        default=15.0,
        ge=0,
        le=600,
        description="With restart_on_stall: seconds the peer tries to leave cleanly (final checkpoint, "
        "'leaving' record) before it exits anyway",
    )


@dataclass
class _Signal:
    name: str
    deadline: float
    due: Callable[[], bool]
    last: float  # monotonic time of the last progress
    due_since: float | None = None  # since when it is due without a break (None: not due at the last look)
    stalled_at: float | None = None  # when the checker found it stalled (None: not stalled)


class Watchdog:
    """Named progress signals, each with a deadline and a due predicate, and the thread that checks them.

    ``due`` runs on the checker thread: it must be cheap and take no lock that the watched work may hold
    (read a counter or a length). A signal is stalled when it was due, without a break, for longer than its
    deadline since its last progress (``beat``), whichever came later; it recovers on the next ``beat`` or
    when it is no longer due.
    """

    def __init__(
        self,
        config: WatchdogConfig | None = None,
        *,
        prefix: Callable[[], str] = lambda: "",
        on_stall: Callable[[list[str]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config or WatchdogConfig()
        self.prefix = prefix
        self.on_stall = on_stall
        self.clock = clock
        self.stalls_total = 0
        self._signals: dict[str, _Signal] = {}
        self._last: dict[str, float] = {}  # name -> time of the last beat (the hot path writes only this)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the owner's side ---------------------------------------------------------------------------
    def watch(self, name: str, deadline: float, due: Callable[[], bool] | None = None) -> None:
        """Watch ``name``: progress is expected every ``deadline`` s while ``due()`` (default: always)."""
        if not name or len(name) > MAX_SIGNAL_NAME:
            raise ValueError(f"a signal name has 1-{MAX_SIGNAL_NAME} characters: {name!r}")
        if deadline <= 0:
            raise ValueError(f"the deadline of {name} must be positive, got {deadline}")
        now = self.clock()
        self._signals[name] = _Signal(name, float(deadline), due or (lambda: True), now)
        self._last[name] = now

    def beat(self, name: str) -> None:
        """Progress on ``name`` (one dictionary assignment: safe on any thread, cheap on hot paths)."""
        self._last[name] = self.clock()

    @property
    def stalled(self) -> list[str]:
        """The names stalled now, sorted (at most ``MAX_STALLED``: what the peer record carries)."""
        return sorted(s.name for s in list(self._signals.values()) if s.stalled_at is not None)[:MAX_STALLED]

    def figures(self) -> dict[str, object]:
        """For the peer's metrics line."""
        return {"stalls_total": self.stalls_total, "stalled": self.stalled}

    # ---- checking -------------------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Look at every signal once; returns the names found stalled by this look (logged, dumped)."""
        now = self.clock()
        found: list[str] = []
        for signal in list(self._signals.values()):
            last = max(signal.last, self._last.get(signal.name, signal.last))
            signal.last = last
            try:
                due = bool(signal.due())
            except Exception as exc:  # a predicate that fails says nothing about progress
                logger.debug("due predicate of %s failed: %r", signal.name, exc)
                due = False
            if signal.stalled_at is not None and (last > signal.stalled_at or not due):
                why = "progress resumed" if last > signal.stalled_at else "no longer due"
                logger.warning(
                    "%s recovered: %s %s after %.1f s",
                    self.prefix(),
                    signal.name,
                    why,
                    now - signal.stalled_at,
                )
                signal.stalled_at = None
            if not due:
                signal.due_since = None
                continue
            if signal.due_since is None:
                signal.due_since = now
            waited = now - max(last, signal.due_since)
            if signal.stalled_at is None and waited > signal.deadline:
                signal.stalled_at = now
                self.stalls_total += 1
                found.append(signal.name)
                logger.error(
                    "%s stalled: %s no progress for %.1f s (deadline %.0f s)",
                    self.prefix(),
                    signal.name,
                    waited,
                    signal.deadline,
                )
        if found:
            logger.error("%s what each thread waits on:\n%s", self.prefix(), dump_threads())
            if self.on_stall is not None:
                self.on_stall(found)
        return found

    def period(self) -> float:
        deadlines = [s.deadline for s in self._signals.values()] or [1.0]
        return min(CHECK_PERIOD_MAX, max(CHECK_PERIOD_MIN, min(deadlines) / 4))

    def start(self) -> Watchdog:
        """Start checking (deadlines count from now). No-op when disabled or already started."""
        if not self.config.enabled or self._thread is not None:
            return self
        now = self.clock()
        for signal in self._signals.values():
            signal.last = self._last[signal.name] = now
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop checking (the daemon thread ends at its next look; nothing waits for it)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period()):
            try:
                self.check()
            except Exception:  # the watchdog itself must not die
                logger.exception("%s watchdog check failed", self.prefix())


def exit_stalled(grace: float, prefix: str = "") -> None:
    """Give the peer's own clean stop ``grace`` seconds (the caller asked for it: ``stop_event``), then exit
    ``EXIT_STALLED`` at once whatever hangs: logs flushed, child processes (DHT child, p2pd, averagers)
    killed by parent pid, ``os._exit`` (a hivemind thread may never return). Never returns."""
    time.sleep(grace)  # a main thread that stops in time exits EXIT_STALLED itself (``cli.run_peer``)
    logger.error("%s did not stop within %.0f s of a stall: exiting %d now", prefix, grace, EXIT_STALLED)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        from echo_p2p.cli import kill_descendants
        from echo_p2p.net.sockets import remove_private_socket_dir

        kill_descendants()
        remove_private_socket_dir()
    finally:
        os._exit(EXIT_STALLED)


def dump_threads(
    max_threads: int = DUMP_THREADS, max_frames: int = DUMP_FRAMES, max_chars: int = DUMP_CHARS
) -> str:
    """Every thread's name and innermost stack frames (what it waits on), then this process's child
    processes and their state; bounded in threads, frames and characters."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    parts = []
    for ident, frame in list(frames.items())[:max_threads]:
        stack = "".join(traceback.format_stack(frame, limit=max_frames))
        parts.append(f'Thread "{names.get(ident, "?")}" ({ident}):\n{stack}')
    if len(frames) > max_threads:
        parts.append(f"... {len(frames) - max_threads} more threads")
    parts.append(_children())
    text = "\n".join(parts)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n... ({len(text) - max_chars} more characters)"
    return text


def _children() -> str:
    """This process's descendants (pid, name, state): a child frozen or gone is visible here."""
    try:
        import psutil

        found = psutil.Process().children(recursive=True)
    except Exception as exc:
        return f"child processes: unknown ({exc!r})"
    lines = []
    for proc in found[:DUMP_THREADS]:
        try:
            lines.append(f"  pid {proc.pid} {proc.name()} ({proc.status()})")
        except Exception:
            lines.append(f"  pid {proc.pid} (gone)")
    return "child processes:\n" + ("\n".join(lines) if lines else "  none")
