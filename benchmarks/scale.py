"""Scaling benchmark: 1, 2, 4, 8, 16 inference peers feeding one real trainer on 127.0.0.1.

What runs (every process in its own process group, stopped by process group id only):

* a bootstrap (``python -m echo_p2p.bootstrap``) and one real trainer peer (``python -m echo_p2p.peer --role
  trainer --mode async``, tiny model, ``count`` task, one torch thread: the flags ``echo_p2p.local`` uses);
* rollout groups recorded once at the start by ``InferencePeer._sample`` (the inference peer's own sampling
  and scoring code) with the tiny model on the ``count`` task (subcommand ``_record``);
* N replay peers (subcommand ``_replay``), each its own process, DHT node and identity, announced in the
  directory as an inference peer (and, like a peer-assisting inference peer, as a provider of the trainer's
  version). Each pushes the recorded groups through the real ``RolloutPusher`` as fast as the acks allow,
  with fresh rollout ids and the policy version retagged to the trainer's current one (read from the push
  acks), so the trainer's real ingest (re-scoring, prompt rebuilt from its id, version window, buffer)
  decides on every group. Replay peers stand in for other machines: they run at nice 19, in this
  process's session (under autogroup scheduling each session gets an equal CPU share, whatever its nice);
* a probe DHT node in this process that reads ``SwarmDirectory.peers()`` and ``.providers()`` in a loop.

Peers are added incrementally (1, then 1 more, then 2 more, ...); once all of them push, a warm-up, then a
window of ``--window`` seconds over which the figures below are taken:

* groups accepted by the trainer's ingest per second (the ACCEPTED verdicts the replay peers received),
  rejected groups by reason, groups consumed by training per second and versions per second (the trainer's
  metrics JSONL);
* trainer CPU (psutil) per accepted group, by where it goes: the main thread (GRPO step, publishing), the
  other threads (ingest validation, RPC loops, heartbeat), p2pd, hivemind's DHT process, the other child
  processes (hivemind.Optimizer's averagers); the replay peers' CPU per pushed group; the whole machine's
  busy share and the part of it taken by processes this benchmark did not start (the machine is shared);
* push ack latency (one push = up to 8 groups, measured by the replay peers), directory read latency
  (probe) and the number of records read; the bytes one peer adds to a directory read (signed entry).

A second arm (``--ingest-peers``, default 1 peer) runs the same trainer peer with a training step that only
counts the groups, so that the buffer is drained as fast as it fills: the capacity of the ingest path alone
(network, parsing, validation with re-scoring) and its CPU cost per group.

Run: ``python benchmarks/scale.py [--peers 1,2,4,8,16] [--ingest-peers 1] [--window 20] [--warmup 6]
[--out benchmarks/results/scale.json] [--workdir DIR]`` (about 5 minutes with the defaults on 2 cores).
Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
RUN_ID = "scale"
HEARTBEAT = 2.0  # as in echo_p2p.local
# Replay peers stand in for other machines: on this one they yield the CPU to the trainer (nice 19; the
# children share this process's session, so that nice values count: see Children.spawn).
REPLAY_NICE = 19
PROVIDER_TTL = 30.0  # a peer-assisting inference peer's ProviderRecord: 30 s, re-announced every 10 s
SUBMIT_BATCH = 16  # groups handed to the pusher at once (an inference peer's prompts_per_batch)


# ---- small helpers ---------------------------------------------------------------------------------------
def wait_until(predicate, timeout: float, what: str, period: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(period)


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file (a torn last line skipped); [] while the file does not exist yet."""
    from echo_p2p.metrics import read_metrics

    return read_metrics(str(path)) if path.exists() else []


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# ---- worker: record rollout groups with the inference peer's own code ----------------------------------------
def record_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="scale.py _record")
    p.add_argument("--out", required=True)
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--initial-peers", required=True)
    p.add_argument("--trusted-trainers", required=True)
    args = p.parse_args(argv)
    import msgpack
    import torch

    from echo_p2p.config import InferenceSection, PeerConfig
    from echo_p2p.ml.engine import TransformersEngine
    from echo_p2p.ml.models import load_policy
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.roles.inference import InferencePeer
    from echo_p2p.tasks.registry import build_task

    torch.set_num_threads(1)
    config = PeerConfig(
        role="inference",
        run_id=RUN_ID,
        network=NetworkConfig(initial_peers=[args.initial_peers], host_maddrs=[LOOPBACK]),
        inference=InferenceSection(trusted_trainers=args.trusted_trainers, seed=0, threads=1),
    )
    peer = InferencePeer(config)  # not started: only its sampling method is used
    try:
        run = config.run
        peer.task = build_task(run.task, run.task_options)
        peer.params = run.sampling_params(peer.task.max_new_tokens)
        model, peer.tokenizer = load_policy(run.model)
        peer.engine = TransformersEngine(model, peer.tokenizer)
        peer.policy_version = 0
        groups = []
        while len(groups) < args.groups:
            ids = peer.task.sample_prompt_ids(peer._rng, config.inference.prompts_per_batch)
            groups += peer._sample(ids, run.group_size)
        groups = groups[: args.groups]
    finally:
        peer.identity.cleanup()
    with open(args.out, "wb") as f:
        f.write(msgpack.packb([g.to_bytes() for g in groups], use_bin_type=True))


# ---- worker: a replay peer ----------------------------------------------------------------------------------
def replay_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="scale.py _replay")
    p.add_argument("--groups", required=True)
    p.add_argument("--log", required=True, help="one JSON line per push")
    p.add_argument("--initial-peers", required=True)
    p.add_argument("--trusted-trainers", required=True)
    args = p.parse_args(argv)
    import msgpack

    from echo_p2p.cli import run_peer
    from echo_p2p.config import InferenceSection, PeerConfig
    from echo_p2p.logs import setup_logging
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.records import ProviderRecord
    from echo_p2p.roles.base import BasePeer
    from echo_p2p.rollout import RolloutGroup
    from echo_p2p.transport.p2p_loop import P2PLoop
    from echo_p2p.transport.rollouts.config import PusherConfig, rollout_namespace
    from echo_p2p.transport.rollouts.ingest import Status
    from echo_p2p.transport.rollouts.push import RolloutPusher

    class LoggingPusher(RolloutPusher):
        """The real pusher; also logs every push (latency, verdicts, the version the ack carries)."""

        def __init__(self, *a, log_path: str, **kw) -> None:
            super().__init__(*a, **kw)  # RolloutPusher keeps trainer_version, the newest an ack reported
            self._log = open(log_path, "a", buffering=1)
            self._latency = 0.0

        async def _push(self, trainer, batch):
            t0 = time.perf_counter()
            try:
                return await super()._push(trainer, batch)
            finally:
                self._latency = time.perf_counter() - t0

        def _settle(self, trainer, batch, ack):
            accepted = sum(1 for a in ack.acks if a.status == Status.ACCEPTED)
            duplicates = sum(1 for a in ack.acks if a.status == Status.DUPLICATE)
            rejected: dict[str, int] = {}
            for a in ack.acks:
                if a.status == Status.REJECTED:
                    rejected[a.reason] = rejected.get(a.reason, 0) + 1
            line = {"t": time.time(), "lat": round(self._latency, 5), "n": len(batch), "acc": accepted}
            line.update(dup=duplicates, rej=rejected, v=int(ack.policy_version), room=int(ack.free_room))
            self._log.write(json.dumps(line) + "\n")
            return super()._settle(trainer, batch, ack)

    class ReplayPeer(BasePeer):
        """An inference peer whose 'sampling' replays recorded groups (see the module doc)."""

        role = "inference"

        def __init__(self, config, groups: list, log_path: str) -> None:
            super().__init__(config)
            self.groups = groups
            self.log_path = log_path
            self.loop = None
            self.pusher = None
            self.submitted = 0
            self._t0 = time.monotonic()
            self._next_provider = 0.0

        def on_start(self) -> None:
            self.loop = P2PLoop.from_dht(self.dht)
            self.pusher = LoggingPusher(
                self.loop,
                self.directory,
                PusherConfig(),
                rollout_namespace(self.keys),
                log_path=self.log_path,
            ).start()

        def _trainer_version(self) -> int | None:
            if self.pusher.trainer_version is not None:
                return self.pusher.trainer_version
            versions = [
                e.record.policy_version
                for e in self.directory.trainers()
                if e.record.policy_version is not None
            ]
            return max(versions) if versions else None

        def work(self) -> None:
            self._t0 = time.monotonic()
            while self.policy_version is None:  # the trainer's version, as a real peer waits for weights
                self.policy_version = self._trainer_version()
                if self.policy_version is None and self.stop_event.wait(0.5):
                    return
            i = 0
            while not self.stop_event.is_set():
                version = self._trainer_version()
                self.policy_version = version if version is not None else self.policy_version
                batch = []
                for _ in range(SUBMIT_BATCH):
                    group = self.groups[i % len(self.groups)]
                    i += 1
                    batch.append(
                        group.model_copy(
                            update={
                                "rollout_id": uuid.uuid4().hex,
                                "policy_version": self.policy_version,
                                "sampler_peer_id": self.peer_id,
                                "sampled_at": time.time(),
                            }
                        )
                    )
                self.submitted += self.pusher.submit(batch, stop_event=self.stop_event)

        def role_fields(self) -> dict[str, Any]:
            elapsed = max(1e-9, time.monotonic() - self._t0)
            return {"rollouts_per_second": round(self.submitted / elapsed, 3)}

        def on_heartbeat(self) -> None:
            if self.policy_version is None or time.monotonic() < self._next_provider:
                return
            self._next_provider = time.monotonic() + PROVIDER_TTL / 3
            record = ProviderRecord(
                peer_id=self.peer_id,
                versions=[self.policy_version],
                encodings=["int8-delta"],
                maddrs=self.maddrs,
            )
            self.directory.announce_provider(record, PROVIDER_TTL)

        def on_shutdown(self) -> None:
            if self.pusher is not None:
                self.pusher.shutdown()
            if self.loop is not None:
                self.loop.shutdown()

    with open(args.groups, "rb") as f:
        groups = [RolloutGroup.from_bytes(b) for b in msgpack.unpackb(f.read(), raw=False)]
    config = PeerConfig(
        role="inference",
        run_id=RUN_ID,
        mode="async",
        network=NetworkConfig(initial_peers=[args.initial_peers], host_maddrs=[LOOPBACK]),
        heartbeat_period=HEARTBEAT,
        log_level="WARNING",
        inference=InferenceSection(trusted_trainers=args.trusted_trainers),
    )
    setup_logging("WARNING")
    run_peer(ReplayPeer(config, groups, args.log), "replay peer")


# ---- worker: a trainer peer that only ingests ---------------------------------------------------------------
def ingest_trainer_main(argv: list[str]) -> None:
    from echo_p2p.cli import EXIT_CONFIG, fail, run_peer
    from echo_p2p.config import ConfigError
    from echo_p2p.logs import setup_logging
    from echo_p2p.peer import parse_config
    from echo_p2p.roles.trainer.peer import TrainerPeer

    class IngestOnlyTrainer(TrainerPeer):
        """The real trainer peer (ingest servicer, validator, buffer, optimizer, publisher); its training
        step only counts the groups, so the buffer is drained as fast as it fills."""

        _next_line = 0.0

        def _train(self, batch: list) -> None:
            self.steps += 1
            self.rollouts_consumed += len(batch)
            if time.monotonic() >= self._next_line:
                self._next_line = time.monotonic() + 0.5
                self.metrics.write(self.policy_version, step=self.steps, **self._counters())

    try:
        config = parse_config(argv)
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    setup_logging(config.log_level)
    run_peer(IngestOnlyTrainer(config), "trainer peer")


# ---- the orchestrator -----------------------------------------------------------------------------------
class Children:
    """Subprocesses in their own process groups; ``stop()`` ends them by process group id only."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, args: list[str], nice: int = 0) -> subprocess.Popen:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # its own process group (stopped by pgid), but not its own session: under the kernel's
                # autogroup scheduling every session gets an equal CPU share whatever its nice value
                process_group=0,
                preexec_fn=(lambda: os.nice(nice)) if nice else None,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None and not name.startswith("record"):
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.workdir}/logs")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM (replay peers first, bootstrap last), then SIGKILL whatever is left of each group."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # leftovers of its own group (p2pd, DHT child)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def cpu_snapshot(pid: int) -> dict[str, Any]:
    """CPU seconds of a process tree: the main thread, the other threads, and each child process by pid as
    ``(kind, cpu)``; kind: ``p2pd``, ``dht`` (hivemind's DHT process: the parent of p2pd) or
    ``other_children`` (in a trainer: hivemind.Optimizer's averager processes)."""
    import psutil

    out: dict[str, Any] = {"main_thread": 0.0, "other_threads": 0.0, "children": {}}
    try:
        proc = psutil.Process(pid)
        for t in proc.threads():
            out["main_thread" if t.id == pid else "other_threads"] += t.user_time + t.system_time
        children = proc.children(recursive=True)
    except psutil.Error:
        return out
    kinds, cpu = {}, {}
    for child in children:
        try:
            times = child.cpu_times()
            cpu[child.pid] = times.user + times.system
            if "p2pd" in child.name():
                kinds[child.pid] = "p2pd"
                kinds[child.ppid()] = "dht"
        except psutil.Error:
            continue
    out["children"] = {p: (kinds.get(p, "other_children"), c) for p, c in cpu.items()}
    return out


def cpu_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    out = {k: after[k] - before[k] for k in ("main_thread", "other_threads")}
    out.update(p2pd=0.0, dht=0.0, other_children=0.0)
    for pid, (kind, cpu) in after["children"].items():
        out[kind] += cpu - before["children"].get(pid, (kind, 0.0))[1]
    out["total"] = sum(out.values())
    return out


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine since boot."""
    import psutil

    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def own_cpu(pids: list[int]) -> float:
    """CPU seconds of these processes and all their descendants (self included)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
    return total


class Probe:
    """A DHT node of its own that times directory reads while a window runs."""

    def __init__(self, maddr: str) -> None:
        from echo_p2p.net.directory import SwarmDirectory
        from echo_p2p.net.identity import load_or_create_identity
        from echo_p2p.net.keys import SwarmKeys
        from echo_p2p.net.network_config import NetworkConfig
        from echo_p2p.net.node import start_dht

        self.keys = SwarmKeys(RUN_ID)
        self.identity = load_or_create_identity(None)
        network = NetworkConfig(initial_peers=[maddr], host_maddrs=[LOOPBACK])
        self.dht = start_dht(network, self.identity, [self.keys])
        self.directory = SwarmDirectory(self.dht, self.keys, self.identity, request_timeout=5.0)
        self.samples: list[tuple[float, int, float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, period: float = 0.5) -> None:
        self.samples = []
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(period):
                t0 = time.perf_counter()
                peers = self.directory.peers()
                t1 = time.perf_counter()
                version = max((e.record.version for e in self.directory.policies()), default=0)
                providers = self.directory.providers(version)
                t2 = time.perf_counter()
                self.samples.append((t1 - t0, len(peers), t2 - t1, len(providers)))

        self._thread = threading.Thread(target=loop, name="probe", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        peers_s = [s[0] for s in self.samples]
        prov_s = [s[2] for s in self.samples]
        ms = lambda x: None if x is None else round(1e3 * x, 2)  # noqa: E731
        return {
            "reads": len(self.samples),
            "peers_ms_p50": ms(quantile(peers_s, 0.5)),
            "peers_ms_p95": ms(quantile(peers_s, 0.95)),
            "providers_ms_p50": ms(quantile(prov_s, 0.5)),
            "providers_ms_p95": ms(quantile(prov_s, 0.95)),
            "peer_records": max((s[1] for s in self.samples), default=0),
            "provider_records": max((s[3] for s in self.samples), default=0),
        }

    def trainer_ready(self) -> bool:
        return any(
            e.record.accepts_rollouts and e.record.state == "running" for e in self.directory.trainers()
        )

    def close(self) -> None:
        from echo_p2p.net.node import stop_dht

        stop_dht(self.dht)
        self.identity.cleanup()


def directory_entry_bytes(maddr: str) -> dict[str, Any]:
    """Bytes one peer adds to the DHT value of the peers / providers key (signed, as hivemind stores it)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue
    from hivemind.dht.validation import DHTRecord
    from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE
    from hivemind.utils import MSGPackSerializer, get_dht_time

    from echo_p2p import PROTOCOL_VERSION, __version__
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.records import PeerRecord, ProviderRecord

    keys = SwarmKeys(RUN_ID)
    identity = load_or_create_identity(None)
    try:
        validator = RSASignatureValidator(identity.private_key)
        peer = PeerRecord(
            protocol=PROTOCOL_VERSION,
            peer_id=identity.peer_id,
            role="inference",
            software_version=__version__,
            mode="async",
            policy_version=123,
            maddrs=[maddr.rsplit("/p2p/", 1)[0] + f"/p2p/{identity.peer_id}"],
            tokens_per_second=1234.5,
            rollouts_per_second=12.345,
        )
        provider = ProviderRecord(
            peer_id=identity.peer_id,
            versions=[123],
            encodings=["int8-delta"],
            maddrs=peer.maddrs,
            stream_id="0" * 32,
            manifests=["0" * 64],
        )
        out: dict[str, Any] = {"hivemind_max_msg_bytes": DEFAULT_MAX_MSG_SIZE}
        pairs = (("peer", keys.peers(1, 0), peer), ("provider", keys.providers(1, 0, 123), provider))
        for name, key, record in pairs:
            key_id = DHTID.generate(source=key).to_bytes()
            subkey = MSGPackSerializer.dumps(identity.owner_key)
            value = MSGPackSerializer.dumps(record.to_wire())
            exp = get_dht_time() + 6
            signed = validator.sign_value(DHTRecord(key_id, subkey, value, exp))
            sizes = []
            for n in (1, 101):
                d = DictionaryDHTValue()
                for i in range(n):  # distinct subkeys of the same length
                    d.store(subkey[:-8] + i.to_bytes(8, "big"), signed, exp)
                sizes.append(len(d.packb()))
            per_entry = (sizes[1] - sizes[0]) / 100
            out[name] = {
                "record_bytes": len(value),
                "signed_entry_bytes": round(per_entry, 1),
                "max_records_per_read": int(DEFAULT_MAX_MSG_SIZE // per_entry),
            }
        return out
    finally:
        identity.cleanup()


def window_figures(logs: list[Path], metrics_dir: Path, t0: float, t1: float) -> dict[str, Any]:
    """Ingest verdicts and ack latency (replay peers' push logs) and consumption (trainer metrics)."""
    accepted = duplicates = pushes = pushed = 0
    rejected: dict[str, int] = {}
    latencies = []
    for path in logs:
        for line in read_jsonl(path):
            if not t0 <= line["t"] < t1:
                continue
            pushes += 1
            pushed += line["n"]
            accepted += line["acc"]
            duplicates += line["dup"]
            latencies.append(line["lat"])
            for reason, count in line["rej"].items():
                rejected[reason] = rejected.get(reason, 0) + count
    span = t1 - t0
    out: dict[str, Any] = {
        "pushes": pushes,
        "groups_pushed": pushed,
        "accepted_groups_per_s": accepted / span,
        "accepted": accepted,
        "duplicates": duplicates,
        "rejected": rejected,
        "ack_ms_p50": None if not latencies else round(1e3 * statistics.median(latencies), 1),
        "ack_ms_p95": None if not latencies else round(1e3 * quantile(latencies, 0.95), 1),
    }
    lines = []
    for path in metrics_dir.glob("trainer-*.jsonl"):
        lines += [x for x in read_jsonl(path) if "rollouts_consumed" in x]
    lines.sort(key=lambda x: x["time"])
    before = [x for x in lines if x["time"] <= t0]
    upto = [x for x in lines if x["time"] <= t1]
    if before and upto and upto[-1]["time"] > before[-1]["time"]:
        a, b = before[-1], upto[-1]
        dt = b["time"] - a["time"]
        out["consumed_groups_per_s"] = (b["rollouts_consumed"] - a["rollouts_consumed"]) / dt
        out["versions_per_s"] = ((b["version"] or 0) - (a["version"] or 0)) / dt
        out["dropped_stale"] = b.get("dropped_stale", 0) - a.get("dropped_stale", 0)
        out["trainer_version"] = b["version"]
        out["trainer_idle_fraction"] = b.get("idle_fraction")
    return out


def measure_window(
    seconds: float,
    probe: Probe,
    trainer_pid: int,
    replay_pids: list[int],
    logs: list[Path],
    metrics_dir: Path,
) -> dict[str, Any]:
    """Sleep through one window while the probe reads the directory; the window's figures."""
    probe.start()
    snap0 = cpu_snapshot(trainer_pid), [cpu_snapshot(p) for p in replay_pids], own_cpu([os.getpid()])
    busy0, tot0 = machine_busy()
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    snap1 = cpu_snapshot(trainer_pid), [cpu_snapshot(p) for p in replay_pids], own_cpu([os.getpid()])
    busy1, tot1 = machine_busy()
    dht = probe.stop()
    span = t1 - t0
    figures = window_figures(logs, metrics_dir, t0, t1)
    trainer_cpu = cpu_delta(snap0[0], snap1[0])
    replay_cpu: dict[str, float] = {}
    for before, after in zip(snap0[1], snap1[1], strict=True):
        for k, v in cpu_delta(before, after).items():
            replay_cpu[k] = replay_cpu.get(k, 0.0) + v
    accepted = max(1, figures["accepted"])
    busy = (busy1 - busy0) / max(1e-9, tot1 - tot0)  # share of all cores
    ours = snap1[2] - snap0[2]  # CPU seconds of this process and every process it started
    return {
        "window_s": round(span, 2),
        **figures,
        "trainer_cpu_s": {k: round(v, 3) for k, v in trainer_cpu.items()},
        "trainer_cpu_cores": trainer_cpu["total"] / span,
        "trainer_cpu_ms_per_accepted_group": 1e3 * trainer_cpu["total"] / accepted,
        "trainer_ingest_cpu_ms_per_accepted_group": 1e3
        * (trainer_cpu["other_threads"] + trainer_cpu["p2pd"])
        / accepted,
        "replay_cpu_s": {k: round(v, 3) for k, v in replay_cpu.items()},
        "replay_cpu_cores": replay_cpu["total"] / span,
        "replay_cpu_ms_per_pushed_group": 1e3 * replay_cpu["total"] / max(1, figures["groups_pushed"]),
        "machine_busy_fraction": busy,
        "others_cpu_cores": max(0.0, busy * (os.cpu_count() or 1) - ours / span),
        "dht": dht,
    }


def run(args: argparse.Namespace, counts: list[int], ingest_only: bool, workdir: Path) -> dict[str, Any]:
    """One arm: a bootstrap, a trainer (real or ingest-only), the recording, then replay peers added up to
    each count of ``counts`` in turn, one window each."""
    workdir.mkdir(parents=True, exist_ok=True)
    children = Children(workdir)
    metrics_dir = workdir / "metrics"
    results: dict[str, Any] = {"runs": []}
    probe = None
    started = time.monotonic()
    try:
        maddrs_file = workdir / "bootstrap.maddrs"
        children.spawn(
            "bootstrap",
            ["-m", "echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs_file)]
            + ["--run-id", RUN_ID, "--log-level", "WARNING"],
        )
        wait_until(maddrs_file.exists, 60, "bootstrap ready")
        maddr = maddrs_file.read_text().split()[0]

        from echo_p2p.guard.trust import trainer_key_line
        from echo_p2p.net.identity import load_or_create_identity

        trainer_id = workdir / "trainer.id"
        trusted = workdir / "trusted-trainers.txt"
        trusted.write_text(trainer_key_line(load_or_create_identity(str(trainer_id))) + "\n")
        trainer_yaml = workdir / "trainer.yaml"
        trainer_yaml.write_text(f"metrics_period: {HEARTBEAT}\n")
        peer_args = [
            *("--role", "trainer", "--run-id", RUN_ID, "--initial-peers", maddr, "--host-maddrs", LOOPBACK),
            *("--mode", "async", "--metrics-dir", str(metrics_dir), "--heartbeat-period", str(HEARTBEAT)),
            *("--threads", "1", "--task", "count", "--model", "tiny", "--identity-path", str(trainer_id)),
            *("--config", str(trainer_yaml)),
        ]
        if ingest_only:
            trainer = children.spawn(
                "trainer", [str(Path(__file__).resolve()), "_ingest_trainer", *peer_args]
            )
        else:
            trainer = children.spawn("trainer", ["-m", "echo_p2p.peer", *peer_args])
        groups_file = workdir / "groups.msgpack"
        record = children.spawn(
            "record",
            [
                str(Path(__file__).resolve()),
                "_record",
                "--out",
                str(groups_file),
                "--groups",
                str(args.groups),
            ]
            + ["--initial-peers", maddr, "--trusted-trainers", str(trusted)],
        )
        probe = Probe(maddr)
        results["directory_entry"] = directory_entry_bytes(maddr)
        code = record.wait(timeout=180)
        if code != 0 or not groups_file.exists():
            raise RuntimeError(f"recording rollouts failed (code {code}); see {workdir}/logs/record.log")
        results["recorded"] = recorded_figures(groups_file)
        wait_until(lambda: children.check_alive() or probe.trainer_ready(), 180, "trainer ready", 0.5)
        arm = "ingest-only trainer" if ingest_only else "trainer"
        print(f"[{time.monotonic() - started:5.1f} s] bootstrap, {arm} and probe up", flush=True)

        replay_logs: list[Path] = []
        for n in counts:
            t_spawn = time.monotonic()
            while len(replay_logs) < n:
                i = len(replay_logs)
                log = workdir / "pushes" / f"replay-{i}.jsonl"
                log.parent.mkdir(parents=True, exist_ok=True)
                replay_logs.append(log)
                children.spawn(
                    f"replay-{i}",
                    [
                        str(Path(__file__).resolve()),
                        "_replay",
                        "--groups",
                        str(groups_file),
                        "--log",
                        str(log),
                    ]
                    + ["--initial-peers", maddr, "--trusted-trainers", str(trusted)],
                    nice=REPLAY_NICE,
                )

            def all_pushing() -> bool:
                children.check_alive()
                return all(p.exists() and p.stat().st_size > 0 for p in replay_logs)

            wait_until(all_pushing, 120 + 10 * n, f"{n} replay peers pushing", 0.5)
            joined_s = time.monotonic() - t_spawn
            time.sleep(args.warmup)
            children.check_alive()
            replay_pids = [p.pid for name, p in children.procs if name.startswith("replay-")]
            row = measure_window(args.window, probe, trainer.pid, replay_pids, replay_logs, metrics_dir)
            row = {"peers": n, "joined_s": round(joined_s, 1), **row}
            row["accepted_rollouts_per_s"] = row["accepted_groups_per_s"] * results["recorded"]["group_size"]
            dht = row["dht"]
            results["runs"].append(row)
            print(
                f"[{time.monotonic() - started:5.1f} s] {n:>2} peers: {row['accepted_groups_per_s']:.1f} groups/s "
                f"accepted, {fmt(row.get('consumed_groups_per_s'), '.1f')} consumed, rejected {row['rejected']}, "
                f"trainer {row['trainer_cpu_ms_per_accepted_group']:.1f} ms CPU/group, ack p50 "
                f"{fmt(row['ack_ms_p50'], '.0f')} ms, peers() p50 {fmt(dht['peers_ms_p50'], '.1f')} ms",
                flush=True,
            )
    finally:
        if probe is not None:
            probe.close()
        children.stop()
    return results


def recorded_figures(path: Path) -> dict[str, Any]:
    import msgpack

    from echo_p2p.rollout import RolloutGroup

    with open(path, "rb") as f:
        raw = msgpack.unpackb(f.read(), raw=False)
    groups = [RolloutGroup.from_bytes(b) for b in raw]
    completions = [c for g in groups for c in g.completions]
    return {
        "groups": len(groups),
        "group_size": groups[0].group_size,
        "bytes_per_group": round(sum(len(b) for b in raw) / len(raw), 1),
        "tokens_per_completion": round(sum(len(c.token_ids) for c in completions) / len(completions), 2),
        "mean_reward": round(sum(c.claimed_reward for c in completions) / len(completions), 4),
    }


def print_table(results: dict[str, Any], arm: str) -> None:
    rec = results["recorded"]
    cfg = results["config"]
    runs = results[arm]
    if not runs:
        return
    print(
        f"\n{'ingest-only' if arm == 'ingest_only_runs' else 'real'} trainer (tiny model, count task, 1 torch thread), "
        f"{rec['group_size']} completions per group ({rec['bytes_per_group']:.0f} B); {cfg['window_s']:.0f} s "
        f"window after {cfg['warmup_s']:.0f} s warm-up; {results['machine']['cpu_count']} cores"
    )
    head = (
        f"{'peers':>5} {'accepted/s':>10} {'consumed/s':>10} {'vers/s':>6} {'rejected (groups)':>28} "
        f"{'ack p50/p95':>11} {'peers() p50/p95':>15} {'providers() p50/p95':>19} {'records':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in runs:
        rej = " ".join(f"{k}:{v}" for k, v in sorted(r["rejected"].items())) or "0"
        dht = r["dht"]
        print(
            f"{r['peers']:>5} {r['accepted_groups_per_s']:>10.1f} {fmt(r.get('consumed_groups_per_s'), '.1f'):>10} "
            f"{fmt(r.get('versions_per_s'), '.2f'):>6} {rej:>28} "
            f"{fmt(r['ack_ms_p50'], '.0f') + '/' + fmt(r['ack_ms_p95'], '.0f'):>11} "
            f"{fmt(dht['peers_ms_p50'], '.1f') + '/' + fmt(dht['peers_ms_p95'], '.1f'):>15} "
            f"{fmt(dht['providers_ms_p50'], '.1f') + '/' + fmt(dht['providers_ms_p95'], '.1f'):>19} "
            f"{str(dht['peer_records']) + '+' + str(dht['provider_records']):>7}"
        )
    head = (
        f"\n{'peers':>5} {'trainer cores':>13} | {'trainer CPU ms per accepted group:':<34} {'total':>6} "
        f"{'train':>6} {'threads':>7} {'p2pd':>6} {'dht':>6} {'optim':>6} | {'replay ms/grp':>13} "
        f"{'machine busy':>12} {'others':>6}"
    )
    print(head)
    print("-" * (len(head) - 1))
    for r in runs:
        c = r["trainer_cpu_s"]
        per = {k: 1e3 * v / max(1, r["accepted"]) for k, v in c.items()}
        print(
            f"{r['peers']:>5} {r['trainer_cpu_cores']:>13.2f} | {'':<34} {per['total']:>6.2f} "
            f"{per['main_thread']:>6.2f} {per['other_threads']:>7.2f} {per['p2pd']:>6.2f} {per['dht']:>6.2f} "
            f"{per['other_children']:>6.2f} | {r['replay_cpu_ms_per_pushed_group']:>13.2f} "
            f"{r['machine_busy_fraction']:>12.0%} {r['others_cpu_cores']:>6.2f}"
        )


def print_legend(results: dict[str, Any]) -> None:
    rec = results["recorded"]
    de = results["directory_entry"]
    print(
        f"\naccepted/s, consumed/s: rollout groups per second (x{rec['group_size']} completions); rejected: groups "
        "refused in the window, by reason.\nack: ms per push of up to 8 groups, seen by the replay peers. "
        "peers()/providers(): directory reads from a probe node (ms); records: peer + provider records read.\n"
        "trainer CPU: train = main thread (GRPO step, publishing); threads = its other threads (ingest "
        "validation, RPC loops, heartbeat); p2pd; dht = hivemind's DHT process; optim = hivemind.Optimizer's "
        "averager processes.\nreplay ms/grp: CPU of the replay peers (all processes) per group pushed. machine "
        "busy: share of all cores; others: cores used by processes this benchmark did not start.\n"
        f"directory entry: {de['peer']['signed_entry_bytes']:.0f} B per peer record, "
        f"{de['provider']['signed_entry_bytes']:.0f} B per provider record (signed); a read of more than "
        f"{de['peer']['max_records_per_read']} peer records exceeds hivemind's {de['hivemind_max_msg_bytes']} B "
        "message limit."
    )


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM: stop like Ctrl-C, through the finally blocks that stop the children


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    workers = {"_record": record_main, "_replay": replay_main, "_ingest_trainer": ingest_trainer_main}
    if argv and argv[0] in workers:
        sys.path.insert(0, str(ROOT))
        workers[argv[0]](argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--peers", default="1,2,4,8,16", help="inference peer counts with the real trainer ('' to skip)"
    )
    p.add_argument(
        "--ingest-peers", default="1", help="inference peer counts with the ingest-only trainer ('' to skip)"
    )
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per peer count (default 20)")
    p.add_argument("--warmup", type=float, default=6.0, help="seconds after all peers push, before a window")
    p.add_argument("--groups", type=int, default=128, help="rollout groups recorded and replayed")
    p.add_argument("--out", default=str(HERE / "results" / "scale.json"), help="JSON results file")
    p.add_argument(
        "--workdir", default=None, help="keep logs and metrics here (default: a temp dir, removed)"
    )
    args = p.parse_args(argv)
    try:
        counts = [
            sorted({int(x) for x in text.split(",") if x.strip()}) for text in (args.peers, args.ingest_peers)
        ]
    except ValueError:
        p.error("--peers and --ingest-peers take comma-separated integers")
    if args.window <= 0 or args.warmup < 0 or not any(counts) or min(min(c, default=1) for c in counts) < 1:
        p.error("need --window > 0, --warmup >= 0 and at least one peer count, each >= 1")
    sys.path.insert(0, str(ROOT))
    import shutil

    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="echo-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "benchmark": "scale",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python benchmarks/scale.py", *argv]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "config": {
            "peers": counts[0],
            "ingest_peers": counts[1],
            "window_s": args.window,
            "warmup_s": args.warmup,
            "groups_replayed": args.groups,
            "trainer": "python -m echo_p2p.peer --role trainer --mode async --model tiny --task count --threads 1",
            "heartbeat_s": HEARTBEAT,
            "replay_nice": REPLAY_NICE,
        },
    }
    try:
        for key, arm_counts, ingest_only in (
            ("runs", counts[0], False),
            ("ingest_only_runs", counts[1], True),
        ):
            results[key] = []
            if arm_counts:
                arm = run(args, arm_counts, ingest_only, workdir / key)
                results[key] = arm.pop("runs")
                results.update({k: v for k, v in arm.items() if k not in results})
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    results["elapsed_s"] = round(time.monotonic() - t0, 1)
    print_table(results, "runs")
    print_table(results, "ingest_only_runs")
    print_legend(results)
    print(f"\ntotal {results['elapsed_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
