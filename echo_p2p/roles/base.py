"""What every peer of a run does whatever its role: join, announce on a heartbeat, write metrics, leave.

Owned here: the peer life cycle (``start`` -> ``run`` -> ``shutdown``), the announcer thread that
re-announces the peer's record before it expires, the status line and the metrics line, and the peer's
``watchdog`` (``roles.watchdog``): the base watches ``announce`` (the record stored) and ``heartbeat`` (the
heartbeat's DHT calls coming back), roles add their own signals; a stall is announced (``stalled``) and,
with ``restart_on_stall``, ends the process with ``EXIT_STALLED``. A role subclass
adds its record fields (``role_fields``), its figures (``figures``) and its main loop (``work``), which
runs in the calling thread until ``stop_event`` is set. ``shutdown`` is idempotent and leaves no child
process behind. Callers: ``echo_p2p.peer`` (the CLI) and tests.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from echo_p2p import PROTOCOL_VERSION, __version__
from echo_p2p.cli import EXIT_STALLED
from echo_p2p.config import PeerConfig
from echo_p2p.logs import status_prefix
from echo_p2p.metrics import MetricsWriter
from echo_p2p.net.directory import SwarmDirectory, find_run_record
from echo_p2p.net.identity import Identity, load_or_create_identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.node import neighbour_counts, rejoin_dht, start_dht, stop_dht
from echo_p2p.net.peer_cache import PeerCache
from echo_p2p.net.reachability import Reachability
from echo_p2p.net.records import PeerRecord, SignedRunRecord
from echo_p2p.roles.watchdog import Watchdog, exit_stalled

logger = logging.getLogger(__name__)


#: Deadline (s) of the last announcement a leaving peer makes. Its record keeps the normal lifetime: the DHT
#: replaces a record only with one that expires later, so a shorter-lived "leaving" record would be ignored.
LEAVING_TIMEOUT = 2.0
#: Fewest seconds between two attempts to refill an empty DHT routing table (``_keep_dht_neighbours``).
REJOIN_EVERY = 5.0


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
        self.maddrs: list[str] = []  # what others can dial (net.reachability), re-read on each announcement
        self.reach: Reachability | None = None
        self.peer_cache = PeerCache.next_to(self.config.network.identity_path)
        self._remembered: list[str] = []
        self.reachability = "unreachable"
        self.announcements_failed = 0
        self.exit_code = 0  # what the CLI exits with once the peer stopped (a role sets 1 on a fatal error)
        self.trust = None  # guard.trust.RunTrust: whom this peer takes for the run's trainers
        self._signed_run_record: SignedRunRecord | None = None  # the owner's record, if this peer keeps it
        self._announcer: threading.Thread | None = None  # the peer's record, every heartbeat, nothing else
        self._chores: threading.Thread | None = None  # run record, trust, the role's heartbeat, metrics
        self._announced = False  # a record of this peer was stored once
        self._shutdown_done = False
        self._lock = threading.Lock()
        #: progress signals with deadlines (docs/reliability.md); roles add theirs in their __init__
        self.watchdog = Watchdog(config.watchdog, prefix=self.prefix, on_stall=self._on_stall)
        self.watchdog.watch("announce", config.watchdog.dht_deadline)  # this peer's record stored
        self.watchdog.watch("heartbeat", config.watchdog.dht_deadline)  # the heartbeat's DHT calls returned
        self.watchdog.watch("dht", config.watchdog.dht_deadline)  # a DHT routing table that is not empty
        self.dht_rejoins = (
            0  # times the DHT lost every neighbour and pinged its way back (net.node.rejoin_dht)
        )
        self._next_rejoin = 0.0  # monotonic time before which no rejoin is tried again
        self.slow_heartbeats = 0  # heartbeats whose chores took longer than record_ttl (_judge_heartbeat)

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
        network = self.config.network
        cached = [m for m in self.peer_cache.load() if m not in network.initial_peers]
        if cached:  # peers met before: the run can be joined through them when every bootstrap is down
            network = network.model_copy(update={"initial_peers": [*network.initial_peers, *cached]})
        logger.info("%s joining run %r", self.prefix(), self.config.run_id)
        self.dht = start_dht(network, self.identity, [self.keys])
        self.directory = SwarmDirectory(
            self.dht, self.keys, self.identity, self.config.network.request_timeout
        )
        self.reach = Reachability(self.dht, network.initial_peers)
        self.maddrs, self.reachability = self.reach.current()
        self.trust = self._make_trust()
        self._keep_run_record()
        self._find_run_record()
        self.refresh_trust()
        self.announce()
        logger.info("%s loading the model and the task", self.prefix())
        self.on_start()
        logger.info(
            "%s joined run %r in %.2f s; listening on %s",
            self.prefix(),
            self.config.run_id,
            time.monotonic() - t0,
            ", ".join(self.maddrs) or "(client mode)",
        )
        self.watchdog.start()  # deadlines count from here: joining and loading the model are behind
        self._announcer = threading.Thread(target=self._announce_loop, name="announcer", daemon=True)
        self._announcer.start()
        self._chores = threading.Thread(target=self._chores_loop, name="heartbeat", daemon=True)
        self._chores.start()

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
        self.watchdog.stop()  # leaving takes time and is no stall
        try:
            self.on_shutdown()
        except Exception:
            logger.exception("%s error while stopping the role", self.prefix())
        for thread in (self._announcer, self._chores):
            if thread is not None:
                thread.join(timeout=self.config.network.request_timeout + 1)
        try:  # the run's totals, once nothing counts any more: after the heartbeat's last status line
            figures = {"reachability": self.reachability, **self.figures(), **self.watchdog.figures()}
            if self.directory is not None:
                figures["directory_reads"] = self.directory.read_figures()
            self.metrics.write(self.policy_version, final=True, **figures)
        except Exception as exc:
            logger.debug("could not write the final metrics: %s", exc)
        if self.dht is not None:
            try:
                if self._announced:  # say it leaves (a join refused at start announced nothing)
                    self.announce(state="leaving", timeout=LEAVING_TIMEOUT)
            except Exception as exc:  # leaving must never fail
                logger.debug("could not announce leaving: %s", exc)
            stop_dht(self.dht)
            self.dht = None
        self.identity.cleanup()
        logger.info("%s left the run", self.prefix())

    # ---- trust: whom this peer takes for the run's trainers -------------------------------------------------
    def _make_trust(self):
        """A ``RunTrust`` from the config: the run owner's record (``--join`` / ``--run-record``), else the
        trusted-trainers file, else none (a trainer of a run that declares no trainers)."""
        from echo_p2p.guard.trust import RunTrust, TrustedTrainers
        from echo_p2p.net.run_record import read_file

        config = self.config
        owner = config.run_owner
        if config.run_record:
            record, record_bytes, signature = read_file(config.run_record)
            owner = owner or record.owner_peer_id()
            self._signed_run_record = SignedRunRecord(
                peer_id=self.peer_id, record=record_bytes, signature=signature
            )
        if owner is not None:
            trust = RunTrust(owner=owner, run_id=config.run_id, min_serial=config.run_record_serial)
            if self._signed_run_record is not None and trust.update([self._signed_run_record]):
                self._check_run_settings(trust.record)
            return trust
        path = config.trusted_trainers
        return RunTrust(fixed=TrustedTrainers.from_file(path) if path else None)

    def _find_run_record(self) -> None:
        """Look for a valid record of the owner among the run key's copies (``directory.find_run_record``);
        after ``directory.RUN_RECORD_WAIT`` raise ``NodeStartError`` saying what is there instead (a wrong owner or run
        id, an expired or unsigned record). This node is not yet told the owner (``refresh_trust`` does that
        next), so it refuses none of the copies, and a record signed by someone else can be named."""
        if self.trust.owner is None or self.trust.record is not None:
            return
        from echo_p2p.net.node import NodeStartError

        missing = find_run_record(self.directory, self.trust, stop=self.stop_event)
        if missing is not None:
            raise NodeStartError(missing)
        if self.trust.record is not None:
            logger.info("%s trusts %s", self.prefix(), self.trust.describe())
            self._check_run_settings(self.trust.record)

    def _keep_run_record(self) -> None:
        """Re-store the owner's signed run record under this peer's key (peers given ``--run-record``)."""
        if self._signed_run_record is not None:
            self.directory.announce_run_record(self._signed_run_record, self.config.record_ttl)

    def refresh_trust(self) -> bool:
        """Apply the newest valid run record of the owner found on the DHT and tell this peer's DHT node whom
        to take trainer records from (``SwarmDirectory.follow_trust``); True when the run's trainers are known
        (always, for a trusted-trainers file or a run that declares none)."""
        if self.trust is None:
            return True
        if self.trust.owner is not None and self.trust.update(e.record for e in self.directory.run_records()):
            logger.info("%s trusts %s", self.prefix(), self.trust.describe())
            self._check_run_settings(self.trust.record)
        self.directory.follow_trust(self.trust)
        return self.trust.owner is None or self.trust.record is not None

    def _check_run_settings(self, record) -> None:
        """A run record says what the run trains: a peer configured for something else must not take part."""
        run = self.config.run
        model = run.model.preset or os.path.basename(str(run.model.gguf_file or run.model.path or ""))
        wrong = [
            f"{name} {theirs!r} (this peer: {ours!r})"
            for name, theirs, ours in (
                ("model", record.model, model),
                ("task", record.task, run.task),
                ("mode", record.mode, self.config.mode),
                ("temperature", record.temperature, run.temperature),
                ("top_p", record.top_p, run.top_p),
                ("top_k", record.top_k, run.top_k),
            )
            if theirs is not None and theirs != ours
        ]
        if record.seeded_sampling is not None and record.seeded_sampling != run.seeded_sampling:
            vllm = self.role == "inference" and self.config.inference.engine == "vllm"
            why = ": the vLLM engine draws no seeds, sample with --engine transformers" if vllm else ""
            wrong.append(
                f"seeded_sampling {record.seeded_sampling!r} (this peer: {run.seeded_sampling!r}{why})"
            )
        allowed, precision = record.sampler_precisions, run.sampler_precision()
        if allowed and self.role == "inference" and precision not in allowed:
            wrong.append(f"sampler precisions {allowed!r} (this peer samples with {precision!r})")
        if allowed and self.role == "trainer" and sorted(allowed) != sorted(run.sampler_precisions or []):
            wrong.append(f"sampler precisions {allowed!r} (this trainer: {run.sampler_precisions!r})")
        if wrong:
            flags = {"model": record.model, "task": record.task, "mode": record.mode}
            flags.update(temperature=record.temperature, top_p=record.top_p, top_k=record.top_k)
            fixes = [f"--{k.replace('_', '-')} {v}" for k, v in flags.items() if v is not None]
            fix = " ".join(fixes + ["--no-seeded-sampling"] * (record.seeded_sampling is False))
            message = (
                f"the run record of {record.run_id} says "
                + ", ".join(wrong)
                + f": start this peer with {fix} "
                "(the run's settings), or join another run"
            )
            if self.directory is not None and self._announcer is not None:  # found while running: stop
                logger.error("%s %s; leaving the run", self.prefix(), message)
                self.exit_code = 1
                self.stop_event.set()
            else:
                raise ValueError(message)

    # ---- announcements ------------------------------------------------------------------------------
    def prefix(self) -> str:
        return status_prefix(self.peer_id, self.role, self.policy_version)

    def record(self, state: str = "running") -> PeerRecord:
        if self.reach is not None:
            self.maddrs, self.reachability = self.reach.current()
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
            stalled=self.watchdog.stalled or None,
            **self.role_fields(),
        )

    def announce(
        self, state: str = "running", ttl: float | None = None, timeout: float | None = None
    ) -> bool:
        assert self.directory is not None, "start() first"
        ok = self.directory.announce(self.record(state), ttl or self.config.record_ttl, timeout)
        self._announced = self._announced or ok
        if ok:
            self.watchdog.beat("announce")
        if not ok:
            self.announcements_failed += 1
            logger.warning("%s announcement was not stored by any DHT node", self.prefix())
        return ok

    def _announce_loop(self) -> None:
        """Store this peer's record every heartbeat, on a thread of its own: the record lives 3 heartbeats
        (``record_ttl``), and a liveness announcement queued behind the other heartbeat work (the run
        record, trust, the role's own stores: each a DHT call of up to ``request_timeout``) lapsed while the
        peer was alive and well under load (a trainer missing from ``swarm status`` in a CI run)."""
        while not self.stop_event.wait(self.config.heartbeat_period):
            try:
                self.announce()
            except (Exception, GeneratorExit, asyncio.CancelledError):
                # hivemind's futures can raise BaseExceptions (a GeneratorExit out of a DHT call under a
                # flood killed this thread for good): none of them may end the peer's announcements
                logger.exception("%s announcement failed; will retry", self.prefix())

    def _chores_loop(self) -> None:
        """Every heartbeat: keep the run record, follow the run's trust, the role's ``on_heartbeat``; every
        ``metrics_period``: the status line and the peer cache."""
        next_metrics = time.monotonic()
        while not self.stop_event.wait(self.config.heartbeat_period):
            took: dict[str, float] = {}  # seconds each chore took
            timed = functools.partial(_timed, took)
            try:
                timed("dht_neighbours", self._keep_dht_neighbours)
                timed("run_record", self._keep_run_record)
                timed("trust", self.refresh_trust)
                timed("role", self.on_heartbeat)
                if time.monotonic() >= next_metrics:
                    next_metrics = time.monotonic() + self.config.metrics_period
                    timed("status", self._status)
                    timed("peer_cache", self._remember_peers)
            except (Exception, GeneratorExit, asyncio.CancelledError):
                logger.exception("%s heartbeat failed; will retry", self.prefix())
            self._judge_heartbeat(took)
            self.watchdog.beat("heartbeat")  # its DHT calls came back (each has a deadline), failed or not

    def _judge_heartbeat(self, took: dict[str, float]) -> None:
        """Say so when one heartbeat's chores took longer than a record lives (``record_ttl``): what the
        heartbeat keeps (the publisher election, trust, the status line) was that much late, and which chore
        took the time (each DHT call has a deadline of ``request_timeout``)."""
        total = sum(took.values())
        if total <= self.config.record_ttl:
            return
        self.slow_heartbeats += 1
        slowest = max(took, key=took.__getitem__)
        logger.warning(
            "%s a heartbeat took %.1f s (record_ttl %.1f s), the most in %s: %s",
            self.prefix(),
            total,
            self.config.record_ttl,
            slowest,
            " ".join(f"{k}={v:.1f}" for k, v in took.items()),
        )

    def _keep_dht_neighbours(self) -> None:
        """A DHT node whose routing table emptied (cut off long enough for every neighbour to be dropped)
        stores records only on itself and never reads anyone's: ping the run's bootstraps, the peers
        remembered and the peers still connected until some answer (``net.node.rejoin_dht``), at most
        every ``REJOIN_EVERY`` s. The watchdog's ``dht`` signal beats while the table holds someone."""
        if self.dht is None:
            return
        try:
            table, _ = neighbour_counts(
                self.dht, timeout=self.config.network.request_timeout, connections=False
            )
        except Exception as exc:  # a DHT that does not answer (frozen, dead): the 'dht' signal stays unbeaten
            logger.debug("%s counting the DHT's neighbours failed: %r", self.prefix(), exc)
            return  # and the rest of the heartbeat (metrics included) goes on
        if table > 0:
            self.watchdog.beat("dht")
            return
        now = time.monotonic()
        if now < self._next_rejoin:
            return
        self._next_rejoin = now + REJOIN_EVERY
        maddrs = list(
            dict.fromkeys([*self.config.network.initial_peers, *self._remembered, *self.peer_cache.load()])
        )
        try:
            answered, table = rejoin_dht(self.dht, maddrs, timeout=self.config.network.request_timeout)
        except Exception as exc:
            logger.warning(
                "%s the DHT has no neighbour left and did not answer a rejoin: %r", self.prefix(), exc
            )
            return
        self.dht_rejoins += 1
        log = logger.info if table else logger.warning
        log(
            "%s the DHT had no neighbour left (cut off?): %d of the peers pinged answered, %d in its table now",
            self.prefix(),
            answered,
            table,
        )
        if table:
            self.watchdog.beat("dht")

    def _on_stall(self, names: list[str]) -> None:
        """The watchdog found ``names`` stalled (logged with a thread dump; the next announcement carries
        them). With ``restart_on_stall``: stop, and exit ``EXIT_STALLED`` within ``exit_grace`` s."""
        if not self.config.watchdog.restart_on_stall:
            return
        grace = self.config.watchdog.exit_grace
        logger.error(
            "%s leaving and exiting %d within %.0f s so that its supervisor restarts it (restart_on_stall)",
            self.prefix(),
            EXIT_STALLED,
            grace,
        )
        self.exit_code = EXIT_STALLED
        self.stop_event.set()
        exit_stalled(grace, self.prefix())

    def _remember_peers(self) -> None:
        """Keep the addresses of the bootstraps and of peers met that others can dial directly, next to
        the identity (``net.peer_cache``): the next start joins through them if every bootstrap is down."""
        if self.peer_cache.path is None or self.directory is None:
            return
        trainers, others = [], []
        try:
            entries = [*self.directory.trainers(), *self.directory.peer_sample()]
        except Exception as exc:  # a DHT read that failed: the cache keeps what it had
            logger.debug("%s reading peers for the cache failed: %r", self.prefix(), exc)
            return
        for entry in entries:
            record = entry.record
            if record.state != "running" or any("/p2p-circuit" in m for m in record.maddrs):
                continue
            trusted = (
                record.role == "trainer" and self.trust is not None and self.trust.is_trusted(record.peer_id)
            )
            (trainers if trusted else others).extend(record.maddrs)
        chosen = self.peer_cache.choose(self.config.network.initial_peers, trainers, others, self.peer_id)
        if chosen != self._remembered:
            self._remembered = chosen
            self.peer_cache.save(chosen)

    def _status(self) -> None:
        try:
            table, connected = neighbour_counts(self.dht, timeout=self.config.network.request_timeout)
        except (Exception, GeneratorExit, asyncio.CancelledError):
            table = connected = -1
        figures = {
            "dht_neighbours": table,
            "connections": connected,
            "reachability": self.reachability,
            "dht_rejoins": self.dht_rejoins,
            "slow_heartbeats": self.slow_heartbeats,
        }
        if self.directory is not None:  # this peer's own reads (its weight fetcher's are in ``weights``)
            figures["directory_reads"] = self.directory.read_figures()
        figures.update(self.figures())
        figures.update(self.watchdog.figures())
        self.metrics.write(self.policy_version, **figures)
        logger.info(
            "%s %s",
            self.prefix(),
            " ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, dict)),
        )


def _timed(took: dict[str, float], name: str, chore: Callable[[], object]) -> None:
    """Run ``chore``, writing the seconds it took into ``took[name]`` (raised or not)."""
    began = time.monotonic()
    try:
        chore()
    finally:
        took[name] = time.monotonic() - began
