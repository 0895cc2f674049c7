"""``python -m echo_p2p.local``: a whole swarm on this machine, on 127.0.0.1 — the newcomer's first run.

Owned here: launching a bootstrap, trainer(s) and inference peers as subprocesses (each in its own
process group), watching the run through the swarm directory (a live status table), and stopping every
process it started — on Ctrl-C, on SIGTERM, at the end of ``--duration`` or when a peer dies — by process
group id, never by name. Logs and metrics land in ``--workdir``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from echo_p2p.cli import EXIT_CONFIG, EXIT_START, fail

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@dataclass
class LocalSwarmConfig:
    """What to launch and for how long."""

    run_id: str = "local"
    trainers: int = 1
    inference: int = 2
    mode: str = "async"
    duration: float = 60.0  # seconds; 0 = until Ctrl-C
    task: str = "count"
    model: str = "tiny"
    extra_peer_args: tuple[str, ...] = ()
    # On one machine, inference peers yield the CPU to trainers (on a real swarm each has its own)
    inference_nice: int = 5
    until_reward: float | None = None  # stop once the trainers' 10-step mean reward reaches this
    status_period: float = 5.0
    heartbeat_period: float = 2.0
    workdir: str = field(default_factory=lambda: os.path.join("runs", time.strftime("local-%Y%m%d-%H%M%S")))


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path


class LocalSwarm:
    """Starts and supervises the processes of a local swarm; ``shutdown()`` stops all of them."""

    def __init__(self, config: LocalSwarmConfig):
        self.config = config
        self.workdir = Path(config.workdir)
        self.children: list[Child] = []
        self.stop_event = threading.Event()
        self.bootstrap_maddr: str | None = None

    def _spawn(self, name: str, *args: str, nice: int = 0) -> Child:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [sys.executable, *args],
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        )
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        maddrs_file = self.workdir / "bootstrap.maddrs"
        boot = self._spawn(
            "bootstrap",
            "-m",
            "echo_p2p.bootstrap",
            "--host-maddrs",
            LOOPBACK,
            "--maddrs-file",
            str(maddrs_file),
            "--run-id",
            self.config.run_id,
        )
        deadline = time.monotonic() + timeout
        while not maddrs_file.exists():
            if boot.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap did not start; see {boot.log}")
            if self.stop_event.wait(0.1):
                return
        self.bootstrap_maddr = maddrs_file.read_text().split()[0]
        common = [
            "--run-id",
            self.config.run_id,
            "--initial-peers",
            self.bootstrap_maddr,
            "--host-maddrs",
            LOOPBACK,
            "--mode",
            self.config.mode,
            "--metrics-dir",
            str(self.workdir / "metrics"),
            "--heartbeat-period",
            str(self.config.heartbeat_period),
            "--threads",
            "1",
            "--task",
            self.config.task,
            "--model",
            self.config.model,
            *self.config.extra_peer_args,
        ]
        trusted = self.make_trainer_identities()
        for i in range(self.config.trainers):
            self._spawn(
                f"trainer-{i}",
                *("-m", "echo_p2p.peer", "--role", "trainer", *common),
                *("--identity-path", str(self.workdir / "identities" / f"trainer-{i}.id")),
                *("--checkpoint-dir", str(self.workdir / "checkpoints" / f"trainer-{i}")),
            )
        for i in range(self.config.inference):
            self._spawn(
                f"inference-{i}",
                *("-m", "echo_p2p.peer", "--role", "inference", *common),
                *("--trusted-trainers", str(trusted), "--seed", str(1000 + i)),
                nice=self.config.inference_nice,
            )

    def make_trainer_identities(self) -> Path:
        """Create the trainers' identities up front and the run's trusted-trainers file from them."""
        from echo_p2p.net.identity import load_or_create_identity
        from echo_p2p.transport.trust import trainer_key_line

        lines = ["# trainers of this local run (python -m echo_p2p.transport.trust IDENTITY prints a line)"]
        for i in range(self.config.trainers):
            identity = load_or_create_identity(str(self.workdir / "identities" / f"trainer-{i}.id"))
            lines.append(trainer_key_line(identity))
        path = self.workdir / "trusted-trainers.txt"
        path.write_text("\n".join(lines) + "\n")
        return path

    def dead_children(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def shutdown(self, grace: float = 15.0) -> None:
        """SIGTERM every child (peers first, bootstrap last), then SIGKILL what is left of its group."""
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


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def training_progress(metrics_dir: Path) -> list[dict]:
    """Every per-step line the trainers wrote so far (those with a ``step`` field), oldest first."""
    from echo_p2p.metrics import read_metrics

    lines: list[dict] = []
    for path in sorted(metrics_dir.glob("trainer-*.jsonl")) if metrics_dir.exists() else []:
        lines += [x for x in read_metrics(str(path)) if "step" in x and "reward_mean" in x]
    return sorted(lines, key=lambda x: x["time"])


def format_progress(lines: list[dict], window: int = 10) -> str:
    last = lines[-window:]
    reward = sum(x["reward_mean"] for x in last) / len(last)
    first = lines[:window]
    reward0 = sum(x["reward_mean"] for x in first) / len(first)
    newest = lines[-1]
    return (
        f"training: step {newest['step']}, version {newest['version']}, reward {reward:.3f} "
        f"(first {len(first)} steps: {reward0:.3f}), rollouts consumed {newest.get('rollouts_consumed')}, "
        f"dropped stale {newest.get('dropped_stale', 0)}, trainer idle {100 * newest.get('idle_fraction', 0):.0f}%"
    )


def watch(swarm: LocalSwarm) -> int:
    """Print the run's status table until the duration ends, Ctrl-C, or a child dies; returns an exit code."""
    from echo_p2p.config import NetworkConfig
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.swarm import format_table, peer_rows

    config = swarm.config
    keys = SwarmKeys(config.run_id)
    identity = load_or_create_identity(None)
    network = NetworkConfig(initial_peers=[swarm.bootstrap_maddr], host_maddrs=[LOOPBACK])
    dht = start_dht(network, identity, [keys], client_mode=True)
    directory = SwarmDirectory(dht, keys, identity, request_timeout=5.0)
    t0 = time.monotonic()
    code = 0
    try:
        while not swarm.stop_event.is_set():
            rows = peer_rows(directory.peers(), time.time())
            print(f"\n[{time.monotonic() - t0:5.1f} s] " + format_table(config.run_id, rows), flush=True)
            progress = training_progress(swarm.workdir / "metrics")
            if progress:
                print(format_progress(progress), flush=True)
            dead = [c for c in swarm.dead_children()]
            if dead:
                for c in dead:
                    print(f"{c.name} exited with code {c.proc.returncode}; see {c.log}", file=sys.stderr)
                code = 1
                break
            if config.duration and time.monotonic() - t0 >= config.duration:
                break
            if config.until_reward is not None and progress and len(progress) >= 10:
                recent = progress[-10:]
                if sum(x["reward_mean"] for x in recent) / len(recent) >= config.until_reward:
                    print(f"reward reached {config.until_reward}: stopping", flush=True)
                    break
            swarm.stop_event.wait(config.status_period)
    finally:
        stop_dht(dht)
        identity.cleanup()
    return code


def build_parser() -> argparse.ArgumentParser:
    d = LocalSwarmConfig()
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.local",
        description="Run a whole echo_p2p swarm on this machine (bootstrap, trainers, inference peers on 127.0.0.1).",
    )
    parser.add_argument("--run-id", default=d.run_id)
    parser.add_argument("--trainers", type=int, default=d.trainers, help="number of trainer peers")
    parser.add_argument("--inference", type=int, default=d.inference, help="number of inference peers")
    parser.add_argument("--mode", choices=["sync", "async"], default=d.mode)
    parser.add_argument(
        "--task", default=d.task, help="task of the run (default: count, learnable in minutes)"
    )
    parser.add_argument("--model", choices=["tiny", "smollm2"], default=d.model, help="model preset")
    parser.add_argument("--duration", type=float, default=d.duration, help="seconds to run; 0 = until Ctrl-C")
    parser.add_argument(
        "--until-reward",
        type=float,
        default=None,
        help="stop early once the 10-step mean reward reaches this",
    )
    parser.add_argument("--status-period", type=float, default=d.status_period, help="seconds between tables")
    parser.add_argument(
        "--workdir", default=None, help="logs and metrics go here (default runs/local-<time>)"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from echo_p2p.net.keys import validate_run_id

    try:
        validate_run_id(args.run_id)
        if args.trainers < 1 or args.inference < 0 or args.duration < 0 or args.status_period <= 0:
            raise ValueError("need --trainers >= 1, --inference >= 0, --duration >= 0, --status-period > 0")
    except ValueError as exc:
        fail(str(exc), EXIT_CONFIG)
    config = LocalSwarmConfig(
        run_id=args.run_id,
        trainers=args.trainers,
        inference=args.inference,
        mode=args.mode,
        task=args.task,
        model=args.model,
        duration=args.duration,
        until_reward=args.until_reward,
        status_period=args.status_period,
    )
    if args.workdir:
        config.workdir = args.workdir
    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    swarm = LocalSwarm(config)
    signal.signal(signal.SIGTERM, lambda *_: swarm.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: swarm.stop_event.set())
    code = 0
    try:
        print(f"starting a local swarm in {swarm.workdir} (Ctrl-C stops it)", flush=True)
        swarm.start()
        if not swarm.stop_event.is_set():
            code = watch(swarm)
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_START
    finally:
        swarm.shutdown()
        print(f"stopped {len(swarm.children)} processes; logs and metrics in {swarm.workdir}", flush=True)
        progress = training_progress(swarm.workdir / "metrics")
        if progress:
            print("summary: " + format_progress(progress), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
