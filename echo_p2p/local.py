"""``python -m echo_p2p.local``: a whole swarm on this machine, on 127.0.0.1 — the newcomer's first run.

Owned here: launching a bootstrap, trainer(s) and inference peers as subprocesses (each in its own
process group), watching the run through the swarm directory (a live status table), and stopping every
process it started — on Ctrl-C, on SIGTERM, at the end of ``--duration`` or when a peer dies — by process
group id, never by name. Logs and metrics land in ``--workdir``, with the run's join address
(``join-address``); at the end the trainers' newest checkpoint is exported as a model directory
(``<workdir>/model``, ``echo_p2p.export``) unless ``--no-export``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from echo_p2p.cli import EXIT_CONFIG, EXIT_START, add_task_option_flag, fail, install_stop_handlers
from echo_p2p.forkserver import ForkedProcess, ForkServer, lower_priority
from echo_p2p.local_keys import bootstrap_address, make_run_record
from echo_p2p.local_phases import phases_block
from echo_p2p.report import Runs, print_report, progress_line, reward_reached, step_lines

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
#: Peer flags a model brings to a local run, before ``--peer-args`` (which override them). SmolLM2-135M
#: trains 16 prompts x 16 completions in about 1.5 min per step on one CPU thread, and samples ~40 tokens/s:
#: 4 prompts per step (and per policy version) and per sampling batch keep a few-minute run taking steps.
#: Its learning rate comes from the preset (``echo_p2p.ml.models.PRESET_TRAINER_DEFAULTS``).
MODEL_PEER_ARGS: dict[str, tuple[str, ...]] = {
    "smollm2": ("--prompts-per-step", "4", "--target-batch-size", "4", "--prompts-per-batch", "4"),
}
#: Inference peers of a local run per model when ``--inference`` is not given (default 2). One SmolLM2 peer
#: samples several times what the trainer consumes, and each holds ~3.5 GiB: a second one only takes
#: memory and CPU from the trainer on a small machine.
MODEL_INFERENCE_PEERS: dict[str, int] = {"smollm2": 1}


@dataclass
class LocalSwarmConfig:
    """What to launch and for how long."""

    run_id: str = "local"
    trainers: int = 1
    trainer_delay: float = 0.0  # later trainers start this many seconds after the first step, and apart
    inference: int = 2
    mode: str = "async"
    duration: float = 60.0  # seconds; 0 = until Ctrl-C
    task: str = "count"
    model: str = "tiny"
    extra_peer_args: tuple[str, ...] = ()
    task_options: tuple[str, ...] = ()  # KEY=VALUE, passed to every peer (or the co-located run)
    # CPU priority taken from inference peers (0: none). Paced samplers sample only what the trainer will
    # use, and a niced one refilled the buffer late: the trainer idled 18-27% of the README run at 5, 4-5% at 0
    inference_nice: int = 0
    until_reward: float | None = None  # stop once the trainers' 10-step mean reward reaches this
    colocated: bool = False  # run the co-located baseline (one process) instead of a swarm
    threads: int = 1  # torch threads of each peer (or of the co-located process)
    status_period: float = 5.0
    monitor: bool = False  # serve the monitor page of the run (echo_p2p.monitor) while it runs
    monitor_port: int = 0  # its port on 127.0.0.1 (0: a free one)
    heartbeat_period: float = 2.0
    export: bool = True  # write the final policy (the trainers' newest checkpoint) into <workdir>/model
    fork_server: bool = True  # fork the peers from one process that imported torch & co. once (forkserver)
    workdir: str = field(default_factory=lambda: os.path.join("runs", time.strftime("local-%Y%m%d-%H%M%S")))


@dataclass
class Child:
    name: str
    proc: subprocess.Popen | ForkedProcess
    log: Path


class LocalSwarm:
    """Starts and supervises the processes of a local swarm; ``shutdown()`` stops all of them."""

    def __init__(self, config: LocalSwarmConfig):
        self.config = config
        self.workdir = Path(config.workdir)
        self.children: list[Child] = []
        self.stop_event = threading.Event()
        self.bootstrap_maddr: str | None = None
        self.owner: str | None = None  # peer id of this run's owner key (signs the run record)
        self.join_address: str | None = None  # RUN:OWNER@BOOTSTRAP, once started (not --colocated)
        self.started_at = time.time()
        self._spawn_lock = threading.Lock()  # late trainers start from a timer thread
        self.forks: ForkServer | None = None  # started with the run (``config.fork_server``)

    def _spawn(self, name: str, *args: str, nice: int = 0) -> Child | None:
        """Start a child in a session of its own; None once shutting down (a late trainer must not start
        after ``shutdown`` has collected the children to stop)."""
        with self._spawn_lock:
            if self.stop_event.is_set() and self.children:
                return None
            log = self.workdir / "logs" / f"{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            forked = (
                self.forks.spawn_argv(args, log=log, env=env, nice=nice, name=name) if self.forks else None
            )
            if forked is not None:
                self.children.append(Child(name, forked, log))
                return self.children[-1]
            proc = subprocess.Popen(
                [sys.executable, *args],
                preexec_fn=(lambda: lower_priority(nice)) if nice else None,
                stdout=open(log, "wb"),
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
            )
            self.children.append(Child(name, proc, log))
            return self.children[-1]

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        if self.config.colocated:
            self.start_colocated()
            return
        maddrs_file = self.workdir / "bootstrap.maddrs"
        if self.config.fork_server:  # its imports run while the bootstrap starts
            (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
            self.forks = ForkServer(log=self.workdir / "logs" / "forkserver.log")
        run_record, owner = self.make_run_record()
        self.owner = owner
        # its address is chosen first, so the peers start with it (they knock until it listens)
        boot_identity, boot_listen, self.bootstrap_maddr = bootstrap_address(self.workdir)
        boot = self._spawn(
            "bootstrap",
            *("-m", "echo_p2p.bootstrap", "--host-maddrs", boot_listen),
            *("--identity-path", str(boot_identity), "--maddrs-file", str(maddrs_file)),
            *("--run-record", str(run_record)),
        )
        self.join_address = f"{self.config.run_id}:{owner}@{self.bootstrap_maddr}"
        (self.workdir / "join-address").write_text(self.join_address + "\n")
        common = [
            "--host-maddrs",
            LOOPBACK,
            "--knock-timeout",  # they start with the bootstrap: knock until it listens
            str(timeout),
            "--mode",
            self.config.mode,
            "--metrics-dir",
            str(self.workdir / "metrics"),
            "--heartbeat-period",
            str(self.config.heartbeat_period),
            "--threads",
            str(self.config.threads),
            "--task",
            self.config.task,
            "--model",
            self.config.model,
            *self._task_option_flags(),
            *self._model_flags(),
            *self.config.extra_peer_args,
        ]

        def trainer(i: int) -> None:
            self._spawn(
                f"trainer-{i}",
                *("-m", "echo_p2p.peer", "--role", "trainer", *common),
                *("--run-id", self.config.run_id, "--initial-peers", self.bootstrap_maddr),
                *("--run-record", str(run_record)),
                *("--identity-path", str(self.workdir / "identities" / f"trainer-{i}.id")),
                *("--checkpoint-dir", str(self.workdir / "checkpoints" / f"trainer-{i}")),
            )

        delay = self.config.trainer_delay
        for i in range(self.config.trainers if not delay else 1):
            trainer(i)
        if delay and self.config.trainers > 1:  # the others join the running run, one every `delay` s

            def late() -> None:
                # counted from the run's first training step, not from the launch: a late trainer joins a
                # run that has trained (on a busy machine the first step can take longer than `delay`)
                while not self._trained() and not self.stop_event.wait(0.5):
                    pass
                for i in range(1, self.config.trainers):
                    if self.stop_event.wait(delay):
                        return
                    trainer(i)

            threading.Thread(target=late, name="late-trainers", daemon=True).start()
        for i in range(self.config.inference):
            self._spawn(
                f"inference-{i}",
                *("-m", "echo_p2p.peer", "--role", "inference", *common),
                *("--join", self.join_address, "--seed", str(1000 + i)),
                nice=self.config.inference_nice,
            )
        deadline = time.monotonic() + timeout
        while not maddrs_file.exists():
            if boot.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap did not start; see {boot.log}")
            if self.stop_event.wait(0.1):
                return

    def start_colocated(self) -> None:
        """The baseline: one process that alternates sampling and training (``echo_p2p.colocated``)."""
        config = self.config
        self._spawn(
            "colocated",
            *("-m", "echo_p2p.colocated", "--task", config.task, "--model", config.model),
            *("--steps", "0", "--duration", str(config.duration or 10**9), "--threads", str(config.threads)),
            *("--metrics-dir", str(self.workdir / "metrics"), "--name", config.run_id),
            *self._task_option_flags(),
        )

    def _model_flags(self) -> list[str]:
        """The model's peer flags (``MODEL_PEER_ARGS``); ``--peer-args`` come after them and win."""
        return list(MODEL_PEER_ARGS.get(self.config.model, ()))

    def _task_option_flags(self) -> list[str]:
        return [arg for option in self.config.task_options for arg in ("--task-option", option)]

    def make_run_record(self) -> tuple[Path, str]:
        """The signed run record and its owner's peer id (``local_keys.make_run_record``)."""
        c = self.config
        return make_run_record(self.workdir, c.run_id, c.trainers, c.model, c.task, c.mode)

    def _trained(self) -> bool:
        """A trainer of this run took a training step (its metrics say so)."""
        return bool(step_lines(self.workdir / "metrics"))

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def shutdown(self, grace: float = 15.0) -> None:
        """SIGTERM every child (peers first, bootstrap last), then SIGKILL what is left of its group."""
        with self._spawn_lock:
            self.stop_event.set()  # no late trainer starts from now on
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child.proc, signal.SIGKILL)  # leftovers of the group (p2pd, DHT child), if any
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.forks is not None:
            self.forks.close()


def _signal_group(proc: subprocess.Popen | ForkedProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def watch(swarm: LocalSwarm) -> int:
    """Print the run's status until the duration ends, Ctrl-C, or a child dies; returns an exit code."""
    config = swarm.config
    if config.colocated:
        return _watch_loop(swarm, None)
    from echo_p2p.monitor.status import peer_rows
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.swarm import format_table

    keys = SwarmKeys(config.run_id)
    identity = load_or_create_identity(None)
    network = NetworkConfig(initial_peers=[swarm.bootstrap_maddr], host_maddrs=[LOOPBACK])
    dht = start_dht(network, identity, [keys], client_mode=True, in_process=True)
    directory = SwarmDirectory(dht, keys, identity, request_timeout=5.0)
    monitor = None
    try:
        if config.monitor:
            monitor = start_monitor(swarm, dht, keys, identity)
        return _watch_loop(
            swarm,
            lambda: format_table(
                config.run_id, peer_rows(directory.trainers() + directory.peers(), time.time())
            ),
        )
    finally:
        if monitor is not None:
            for part in monitor:
                part.stop()
        stop_dht(dht)
        identity.cleanup()


def start_monitor(swarm: LocalSwarm, dht, keys, identity) -> tuple:
    """Serve the run's monitor page on 127.0.0.1 from this process's DHT node, with the run owner's trust;
    prints its URL. Returns ``(server, poller)`` to stop."""
    from echo_p2p.guard.trust import RunTrust
    from echo_p2p.monitor.config import MonitorConfig
    from echo_p2p.monitor.embedded import serve_embedded
    from echo_p2p.net.node import neighbour_counts

    config = MonitorConfig(port=swarm.config.monitor_port, poll_period=2.0)
    trust = RunTrust(owner=swarm.owner, run_id=swarm.config.run_id)
    server, poller, url = serve_embedded(
        dht, identity, swarm.config.run_id, trust, config, lambda: neighbour_counts(dht)[1]
    )
    print(f"monitor: {url}", flush=True)
    return server, poller


def _watch_loop(swarm: LocalSwarm, table: Callable[[], str] | None) -> int:
    config = swarm.config
    metrics_dir = swarm.workdir / "metrics"
    t0 = time.monotonic()
    while not swarm.stop_event.is_set():
        head = f"\n[{time.monotonic() - t0:5.1f} s]"
        print(f"{head} {table()}" if table else head, flush=True)
        runs = Runs.load(metrics_dir)  # read once a tick: the progress line and the reward target use it
        progress = progress_line(runs)
        if progress:
            print(progress, flush=True)
        elif table:  # no step yet: what each process is doing (importing, joining, loading, waiting)
            print(phases_block((c.name, c.log) for c in swarm.children), flush=True)
        dead = swarm.dead_children()
        if config.colocated and dead and dead[0].proc.returncode == 0:
            return 0  # the co-located run ended its --duration by itself
        if dead:
            for c in dead:
                print(f"{c.name} exited with code {c.proc.returncode}; see {c.log}", file=sys.stderr)
            return 1
        if config.duration and time.monotonic() - t0 >= config.duration:
            return 0
        if config.until_reward is not None and reward_reached(runs, config.until_reward):
            print(f"reward reached {config.until_reward}: stopping", flush=True)
            return 0
        wait = config.status_period
        if config.duration:  # the duration ends the run on time, not at the next status line
            wait = min(wait, max(0.0, config.duration - (time.monotonic() - t0)))
        swarm.stop_event.wait(wait)
    return 0


def export_final(swarm: LocalSwarm) -> tuple[dict | None, bool]:
    """Export the trainers' newest checkpoint (the final one each writes when it stops) as a model directory,
    ``<workdir>/model``; returns (what was written: path, version, dtype, or None; whether it failed). A
    run that left no checkpoint (stopped before its trainers started) has nothing to export."""
    if swarm.config.colocated or not swarm.config.export:
        return None, False
    try:
        from echo_p2p.export.__main__ import quiet_progress_bars
        from echo_p2p.export.checkpoint import export_checkpoint, newest_checkpoint
        from echo_p2p.export.config import ExportConfig

        quiet_progress_bars()

        newest = newest_checkpoint(sorted((swarm.workdir / "checkpoints").glob("trainer-*")))
        if newest is None:
            print("no trainer checkpoint: no final policy to export", flush=True)
            return None, False
        out = swarm.workdir / "model"
        result = export_checkpoint(newest.path, ExportConfig(out=str(out), overwrite=True))
    except Exception as exc:  # the run's report still comes; the exit code says the export failed
        print(f"error: exporting the final policy failed: {exc}", file=sys.stderr, flush=True)
        return None, True
    return {"path": result.path, "version": result.version, "dtype": result.dtype}, False


def report_end(swarm: LocalSwarm, model: dict | None = None) -> None:
    """Print the run's summary and write summary.json and reward.png into the workdir."""
    config = swarm.config
    what = (
        "co-located"
        if config.colocated
        else f"{config.mode}, {config.trainers} trainer(s), {config.inference} inference"
    )
    print_report(swarm.workdir, f"{config.task} on {config.model} ({what})", swarm.started_at, model)


def build_parser() -> argparse.ArgumentParser:
    d = LocalSwarmConfig()
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.local",
        description="Run a whole echo_p2p swarm on this machine (bootstrap, trainers, inference peers on 127.0.0.1).",
    )
    parser.add_argument("--run-id", default=d.run_id)
    parser.add_argument("--trainers", type=int, default=d.trainers, help="number of trainer peers")
    parser.add_argument(
        "--trainer-delay",
        type=float,
        default=d.trainer_delay,
        help="start the second trainer this many seconds after the run's first training step and the others "
        "as far apart: they join a running run (default 0: all at once)",
    )
    parser.add_argument(
        "--inference",
        type=int,
        default=None,
        help=f"number of inference peers (default {d.inference}; 1 with --model smollm2)",
    )
    parser.add_argument("--mode", choices=["sync", "async"], default=d.mode)
    parser.add_argument(
        "--task", default=d.task, help="task of the run (default: count, learnable in minutes)"
    )
    parser.add_argument("--model", choices=["tiny", "smollm2"], default=d.model, help="model preset")
    add_task_option_flag(parser, pass_through=True)
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds to run; 0 = until Ctrl-C")
    parser.add_argument(
        "--until-reward",
        type=float,
        default=None,
        help="stop early once the 10-step mean reward reaches this",
    )
    parser.add_argument("--status-period", type=float, default=d.status_period, help="seconds between tables")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="run the co-located baseline instead: one process that alternates sampling and training",
    )
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads of each process")
    parser.add_argument(
        "--peer-args",
        default="",
        help="more flags for every peer, e.g. --peer-args='--max-staleness 8' (see python -m echo_p2p.peer --help)",
    )
    parser.add_argument(
        "--workdir", default=None, help="logs and metrics go here (default runs/local-<time>)"
    )
    parser.add_argument(
        "--monitor",
        action="store_true",
        help="serve the run's live monitor page on 127.0.0.1 and print its URL",
    )
    parser.add_argument(
        "--monitor-port",
        type=int,
        default=d.monitor_port,
        help="port of the monitor page (default: a free one)",
    )
    parser.add_argument(
        "--no-fork-server",
        action="store_true",
        help="start every peer as a new interpreter (default: fork them from one process that imported "
        "torch, transformers and hivemind once, ~5 CPU-s less per peer)",
    )
    parser.add_argument(
        "--no-export",
        action="store_true",
        help="do not write the final policy as a model directory (<workdir>/model) at the end",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.inference is None:
        args.inference = MODEL_INFERENCE_PEERS.get(args.model, LocalSwarmConfig.inference)
    from echo_p2p.net.keys import validate_run_id

    try:
        validate_run_id(args.run_id)
        if min(args.trainers - 1, args.inference, args.duration, args.trainer_delay) < 0:
            raise ValueError("need --trainers >= 1 and --inference, --duration, --trainer-delay >= 0")
        if args.status_period <= 0:
            raise ValueError("need --status-period > 0")
        if args.threads < 1:
            raise ValueError("need --threads >= 1")
        if not 0 <= args.monitor_port <= 65535 or (args.monitor and args.colocated):
            raise ValueError("--monitor-port must be 0-65535; --monitor watches a swarm, not --colocated")
        peer_args = tuple(shlex.split(args.peer_args))
        if args.colocated and peer_args:
            raise ValueError("--peer-args applies to swarm peers, not to --colocated")
    except ValueError as exc:
        fail(str(exc), EXIT_CONFIG)
    config = LocalSwarmConfig(
        run_id=args.run_id,
        trainers=args.trainers,
        trainer_delay=args.trainer_delay,
        inference=args.inference,
        mode=args.mode,
        task=args.task,
        model=args.model,
        duration=args.duration,
        until_reward=args.until_reward,
        status_period=args.status_period,
        colocated=args.colocated,
        threads=args.threads,
        extra_peer_args=peer_args,
        task_options=tuple(args.task_option),
        monitor=args.monitor,
        monitor_port=args.monitor_port,
        export=not args.no_export,
        fork_server=not args.no_fork_server,
    )
    if args.workdir:
        config.workdir = args.workdir
    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    from echo_p2p.net.lean_hivemind import use_lean_hivemind

    use_lean_hivemind()  # no torch before the peers start: signing the run record and watching need none
    swarm = LocalSwarm(config)
    install_stop_handlers(swarm.stop_event.set)  # a second Ctrl-C kills every peer's process tree at once
    code = 0
    try:
        what = "the co-located baseline" if config.colocated else f"a local swarm ({config.mode} mode)"
        print(f"starting {what} in {swarm.workdir} (Ctrl-C stops it)", flush=True)
        swarm.start()
        if not config.colocated:
            print(f"join address: {swarm.join_address}", flush=True)
        if not swarm.stop_event.is_set():
            code = watch(swarm)
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_START
    finally:
        swarm.shutdown()
        print(f"stopped {len(swarm.children)} processes; logs and metrics in {swarm.workdir}", flush=True)
        model, export_failed = export_final(swarm)
        if export_failed and code == 0:
            code = 1
        report_end(swarm, model)
    sys.exit(code)


if __name__ == "__main__":
    main()
