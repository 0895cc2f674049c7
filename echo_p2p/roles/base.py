"""What every peer of a run does whatever its role: join, announce on a heartbeat, write metrics, leave.

Owned here: the peer life cycle (``start`` -> ``run`` -> ``shutdown``), the announcer thread that
re-announces the peer's record before it expires, the status line and the metrics line. A role subclass
adds its record fields (``role_fields``), its figures (``figures``) and its main loop (``work``), which
runs in the calling thread until ``stop_event`` is set. ``shutdown`` is idempotent and leaves no child
process behind. Callers: ``echo_p2p.peer`` (the CLI) and tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from echo_p2p import PROTOCOL_VERSION, __version__
from echo_p2p.config import PeerConfig
from echo_p2p.logs import status_prefix
from echo_p2p.metrics import MetricsWriter
from echo_p2p.net.directory import SwarmDirectory
from echo_p2p.net.identity import Identity, load_or_create_identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.node import neighbour_counts, start_dht, stop_dht, visible_maddrs
from echo_p2p.net.records import PeerRecord

logger = logging.getLogger(__name__)

#: Deadline (s) of the last announcement a leaving peer makes. Its record keeps the normal lifetime: the DHT
#: replaces a record only with one that expires later, so a shorter-lived "leaving" record would be ignored.
LEAVING_TIMEOUT = 2.0


class BasePeer:
    """A member of one run. Subclasses set ``role`` and override the hooks below."""

    role: str = ""

    def __init__(self, config: PeerConfig, identity: Identity | None = None):
        if config.role != self.role:
            raise ValueError(f"{type(self).__name__} is a {self.role} peer, config says {config.role}")
        self.config = config
        self.keys = SwarmKeys(config.run_id)
        self.identity = identity or load_or_create_identity(config.network.identity_path)
        self.stop_event = threading.Event()
        self.started_at = time.time()
        self.policy_version: int | None = None
        self.dht = None
        self.directory: SwarmDirectory | None = None
        self.metrics = MetricsWriter(config.metrics_dir, self.role, self.identity.peer_id)
        self.maddrs: list[str] = []
        self.announcements_failed = 0
        self.exit_code = 0  # what the CLI exits with once the peer stopped (a role sets 1 on a fatal error)
        self._announcer: threading.Thread | None = None
        self._shutdown_done = False
        self._lock = threading.Lock()

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # ---- hooks for roles ----------------------------------------------------------------------------
    def role_fields(self) -> dict[str, Any]:
        """Extra ``PeerRecord`` fields this role announces (throughput, buffer room, ...)."""
        return {}

    def figures(self) -> dict[str, Any]:
        """This role's figures for the metrics line."""
        return {}

    def on_start(self) -> None:
        """Called once the DHT is up and the first record is announced."""

    def on_heartbeat(self) -> None:
        """Called by the announcer thread before each announcement (cheap periodic work of the role)."""

    def work(self) -> None:
        """The role's main loop; must return soon after ``stop_event`` is set."""
        self.stop_event.wait()

    def on_shutdown(self) -> None:
        """Release the role's resources (called once, before the DHT stops)."""

    # ---- life cycle -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the DHT node, join the run and announce; raises ``NodeStartError`` on failure."""
        t0 = time.monotonic()
        self.dht = start_dht(self.config.network, self.identity, [self.keys])
        self.directory = SwarmDirectory(
            self.dht, self.keys, self.identity, self.config.network.request_timeout
        )
        self.maddrs = visible_maddrs(self.dht)
        self.announce()
        self.on_start()
        logger.info(
            "%s joined run %r in %.2f s; listening on %s",
            self.prefix(),
            self.config.run_id,
            time.monotonic() - t0,
            ", ".join(self.maddrs) or "(client mode)",
        )
        self._announcer = threading.Thread(target=self._announce_loop, name="announcer", daemon=True)
        self._announcer.start()

    def run(self) -> None:
        """Start (if needed) and run the role's work until ``request_stop`` or a signal."""
        if self.dht is None:
            self.start()
        self.work()

    def request_stop(self) -> None:
        self.stop_event.set()

    def shutdown(self) -> None:
        """Leave the run: stop the role, announce ``leaving``, stop the DHT and its p2pd. Idempotent."""
        with self._lock:
            if self._shutdown_done:
                return
            self._shutdown_done = True
        self.stop_event.set()
        try:
            self.on_shutdown()
        except Exception:
            logger.exception("%s error while stopping the role", self.prefix())
        if self._announcer is not None:
            self._announcer.join(timeout=self.config.network.request_timeout + 1)
        if self.dht is not None:
            try:
                self.announce(state="leaving", timeout=LEAVING_TIMEOUT)
            except Exception as exc:  # leaving must never fail
                logger.debug("could not announce leaving: %s", exc)
            stop_dht(self.dht)
            self.dht = None
        self.identity.cleanup()
        logger.info("%s left the run", self.prefix())

    # ---- announcements ------------------------------------------------------------------------------
    def prefix(self) -> str:
        return status_prefix(self.peer_id, self.role, self.policy_version)

    def record(self, state: str = "running") -> PeerRecord:
        return PeerRecord(
            protocol=PROTOCOL_VERSION,
            peer_id=self.peer_id,
            role=self.role,
            software_version=__version__,
            mode=self.config.mode,
            policy_version=self.policy_version,
            maddrs=self.maddrs,
            started_at=self.started_at,
            updated_at=time.time(),
            state=state,
            **self.role_fields(),
        )

    def announce(
        self, state: str = "running", ttl: float | None = None, timeout: float | None = None
    ) -> bool:
        assert self.directory is not None, "start() first"
        ok = self.directory.announce(self.record(state), ttl or self.config.record_ttl, timeout)
        if not ok:
            self.announcements_failed += 1
            logger.warning("%s announcement was not stored by any DHT node", self.prefix())
        return ok

    def _announce_loop(self) -> None:
        next_metrics = time.monotonic()
        while not self.stop_event.wait(self.config.heartbeat_period):
            try:
                self.on_heartbeat()
                self.announce()
                if time.monotonic() >= next_metrics:
                    next_metrics = time.monotonic() + self.config.metrics_period
                    self._status()
            except (Exception, GeneratorExit, asyncio.CancelledError):
                # hivemind's futures can raise BaseExceptions (a GeneratorExit out of a DHT call under a
                # flood killed this thread for good): none of them may end the peer's announcements
                logger.exception("%s heartbeat failed; will retry", self.prefix())

    def _status(self) -> None:
        try:
            table, connected = neighbour_counts(self.dht, timeout=self.config.network.request_timeout)
        except (Exception, GeneratorExit, asyncio.CancelledError):
            table = connected = -1
        figures = {"dht_neighbours": table, "connections": connected, **self.figures()}
        self.metrics.write(self.policy_version, **figures)
        logger.info(
            "%s %s",
            self.prefix(),
            " ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, dict)),
        )
