"""Benchmark of the weights transport: bytes on the wire, throughput, and distribution to many peers.

(a) Bytes on the wire per encoding relative to fp32 (``benchmarks/weights_codec.py``'s ``bench_wire``).
(b) Fetch throughput of ``WeightFetcher`` from one provider (a trainer publishing full fp32 snapshots)
    relative to a bare hivemind P2P stream of the same bytes between the same two processes (a
    ``ServicerBase`` server-streaming 1 MiB messages: the transport's ceiling), and a plain TCP copy on
    127.0.0.1 for context. Goals: >= 0.8 of the bare stream, >= 125 MB/s.
(c) Time for one int8-delta version of a ~30M-parameter model to reach 1, 4 and 8 inference peers (separate
    processes on 127.0.0.1), with and without peer assistance, and the bytes the trainer uploaded.
    Goal: with assistance, trainer upload <= 2x one version whatever N.
(d) The same in network namespaces joined by veth links to a bridge, the trainer's upload limited with
    ``tc tbf rate 100mbit``. Goal: 8 peers get the version in at most 2x the time 1 peer takes. Skipped with
    a printed reason where ``ip netns`` is not permitted. Every namespace created is deleted, also on failure.

Run: ``python benchmarks/weights.py [--quick] [--out PATH]`` (default ~5 min on 2 CPU cores; --quick ~2).
Workers are this same file started with ``--worker trainer|peer``: JSON commands on stdin, JSON answers on
stdout, logs on stderr. Each worker runs in its own process group, killed by group id at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator  # noqa: UP035 (hivemind reads typing.AsyncIterator)

from hivemind.p2p import ServicerBase

from echo_p2p.proto import weights_pb2

HERE = Path(__file__).resolve().parent
MIB = 1 << 20
NETNS_PREFIX = "echo-wb"
NETNS_SUBNET = "10.77.0"


# ============================================================================================== workers
def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class BareBlobServicer(ServicerBase):
    """Streams ``request.version`` bytes as 1 MiB ``ChunkPart`` messages: hivemind's bare stream."""

    blob = os.urandom(MIB)

    async def rpc_blob(
        self, request: weights_pb2.ChunksRequest, context
    ) -> AsyncIterator[weights_pb2.ChunkPart]:
        left = request.version
        while left > 0:
            n = min(left, MIB)
            yield weights_pb2.ChunkPart(offset=request.version - left, data=self.blob[:n])
            left -= n


def _tcp_server(payload_bytes: int) -> int:
    """A TCP server that sends ``payload_bytes`` to each client; returns its port."""
    srv = socket.socket()
    srv.bind((os.environ.get("BENCH_HOST", "127.0.0.1"), 0))
    srv.listen(4)
    blob = os.urandom(MIB)

    def serve() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                want = int.from_bytes(conn.recv(8), "big")
                left = min(want, payload_bytes)
                while left > 0:
                    n = min(left, MIB)
                    conn.sendall(blob[:n])
                    left -= n

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def worker_main(role: str, host: str, initial: list[str], args: argparse.Namespace) -> None:
    import logging

    import torch

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht, visible_maddrs

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    keys = SwarmKeys("bench-weights")
    identity = load_or_create_identity(None)
    dht = start_dht(
        NetworkConfig(
            host_maddrs=[f"/ip4/{host}/tcp/0"], initial_peers=initial, startup_timeout=120, knock_timeout=120
        ),
        identity,
        [keys],
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if role == "trainer":
            _trainer_loop(dht, identity, keys, args, visible_maddrs(dht))
        else:
            _peer_loop(dht, identity, keys, args)
    finally:
        stop_dht(dht)
        identity.cleanup()


def _trainer_loop(dht, identity, keys, args, maddrs) -> None:
    import torch

    from echo_p2p.transport.weights.publisher import PublisherConfig, WeightPublisher
    from echo_p2p.weights.config import EncodingConfig

    sys.path.insert(0, str(HERE))
    from weights_codec import build_model, named_tensors

    model = build_model(args.model_size)
    tensors = named_tensors(model)
    config = PublisherConfig(
        encoding=EncodingConfig(encoding=args.encoding, chunk_size=args.chunk_size, keyframe_interval=100000)
    )
    publisher = WeightPublisher(dht, identity, keys, config).start()
    bare = BareBlobServicer()
    publisher.endpoint.run(bare.add_p2p_handlers(publisher.endpoint.p2p, namespace="bench"), 30)
    tcp_port = _tcp_server(1 << 40)
    _reply(
        dict(
            ready=True,
            maddrs=maddrs,
            peer_id=identity.peer_id,
            key=identity.public_key_bytes().decode(),
            params=sum(t.numel() for _, t in tensors),
            tcp_port=tcp_port,
        )
    )
    gen = torch.Generator().manual_seed(1)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "publish":
            if cmd["version"] > 0:
                with torch.no_grad():
                    for _, t in tensors:
                        if t.is_floating_point():
                            t.add_(torch.randn(t.shape, generator=gen), alpha=1e-4)
            manifests = publisher.publish(tensors, cmd["version"])
            _reply(
                dict(
                    published_at=time.time(),
                    encode_s=publisher.last_encode_seconds,
                    bytes=[m.total_bytes for m in manifests],
                    encodings=[m.encoding for m in manifests],
                )
            )
        elif cmd["cmd"] == "stats":
            _reply(publisher.stats())
        elif cmd["cmd"] == "quit":
            break
    publisher.shutdown()


def _warm_up_decoder() -> None:
    """Decode a tiny int8-delta version once, so that importing bitsandbytes is not timed."""
    import torch

    from echo_p2p.weights.codec import VersionAssembler, WeightEncoder
    from echo_p2p.weights.config import EncodingConfig

    encoder = WeightEncoder(EncodingConfig(), run_id="warm-up", publisher="warm-up")
    weights = None
    for version in range(2):
        for encoded in encoder.encode([("w", torch.ones(64) * version)], version)[:1]:
            assembler = VersionAssembler(encoded.manifest)
            for i in range(encoded.manifest.num_chunks):
                assembler.add_chunk(i, encoded.get_chunk(i))
            weights = assembler.apply(weights)


def _peer_loop(dht, identity, keys, args) -> None:
    from hivemind.p2p import PeerID

    from echo_p2p.guard.trust import TrustedTrainers
    from echo_p2p.transport.weights.fetch.config import FetcherConfig
    from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher

    _warm_up_decoder()
    _reply(dict(ready=True, peer_id=identity.peer_id))
    fetcher = None
    trace: list[tuple[float, int, int]] = []

    def dump_state(*_) -> None:  # kill -USR1 <peer worker>: what its fetch in progress is waiting for
        state = fetcher.fetch_state() if fetcher is not None else None
        sys.stderr.write(f"fetch state: {json.dumps(state, default=str)}\n")
        sys.stderr.flush()

    signal.signal(signal.SIGUSR1, dump_state)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "trust":
            fetcher = WeightFetcher(
                dht,
                identity,
                keys,
                TrustedTrainers.from_keys([cmd["key"]]),
                FetcherConfig(**json.loads(args.fetcher_config)),
            ).start()
            fetcher.on_progress = lambda p: trace.append((time.time(), p.bytes_done, p.providers))
            _reply(dict(ok=True))
        elif cmd["cmd"] == "fetch":
            fetcher.config.serve = cmd["serve"]
            deadline = time.monotonic() + cmd["timeout"]
            before = dict(fetcher.stats.bytes_by_provider)
            trace.clear()
            while (
                fetcher.version is None or fetcher.version < cmd["version"]
            ) and time.monotonic() < deadline:
                if fetcher.update() is None:
                    time.sleep(0.02)
            stats = fetcher.stats_dict()
            got = {k: v - before.get(k, 0) for k, v in fetcher.stats.bytes_by_provider.items()}
            _reply(
                dict(
                    version=fetcher.version,
                    applied_at=time.time(),
                    transfer_s=stats["transfer_seconds"],
                    fetch_s=stats["fetch_seconds"],
                    fetch_bytes=stats["fetch_bytes"],
                    phases=stats["phases"],
                    trace=trace[:: max(1, len(trace) // 20)] + trace[-1:],
                    bytes_by_provider=got,
                    rejected=stats["rejected"],
                    failures=stats["failures"],
                )
            )
        elif cmd["cmd"] == "bare":

            async def read_bare(p2p, peer: str, nbytes: int) -> float:
                stub = BareBlobServicer.get_stub(p2p, PeerID.from_base58(peer), namespace="bench")
                t0 = time.perf_counter()
                got = 0
                async for part in await stub.rpc_blob(weights_pb2.ChunksRequest(version=nbytes)):
                    got += len(part.data)
                assert got == nbytes
                return time.perf_counter() - t0

            seconds = fetcher.endpoint.run(read_bare(fetcher.endpoint.p2p, cmd["peer_id"], cmd["bytes"]), 300)
            _reply(dict(seconds=seconds))
        elif cmd["cmd"] == "tcp":
            t0 = time.perf_counter()
            with socket.create_connection((cmd["host"], cmd["port"])) as conn:
                conn.sendall(cmd["bytes"].to_bytes(8, "big"))
                left = cmd["bytes"]
                buf = bytearray(MIB)
                while left > 0:
                    n = conn.recv_into(buf, min(left, MIB))
                    if not n:
                        break
                    left -= n
            _reply(dict(seconds=time.perf_counter() - t0))
        elif cmd["cmd"] == "quit":
            break
    if fetcher is not None:
        fetcher.shutdown()


# ============================================================================================ controller
class Worker:
    """A worker process in its own process group, spoken to by JSON lines."""

    def __init__(
        self,
        role: str,
        host: str,
        initial: list[str],
        logdir: Path,
        name: str,
        extra: list[str],
        netns: str | None = None,
    ):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--host", host, *extra]
        for maddr in initial:
            cmd += ["--initial-peer", maddr]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.name = name
        self.log = open(logdir / f"{name}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "BENCH_HOST": host}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            start_new_session=True,
        )
        self._buf = b""

    def send(self, obj: dict[str, Any]) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {self.name} did not answer within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    raise RuntimeError(f"worker {self.name} exited (see {self.log.name})")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, obj: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send(obj)
        return self.recv(timeout)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


class Swarm:
    """A trainer and ``n_peers`` peer workers, on loopback or each in its own network namespace."""

    def __init__(
        self, n_peers: int, logdir: Path, args: argparse.Namespace, *, encoding: str, netns: bool = False
    ):
        self.workers: list[Worker] = []
        self.netns = netns
        extra = [
            "--model-size",
            args.model_size,
            "--encoding",
            encoding,
            "--chunk-size",
            str(args.chunk_size),
            "--fetcher-config",
            args.fetcher_config,
        ]
        host = f"{NETNS_SUBNET}.1" if netns else "127.0.0.1"
        try:
            self.trainer = Worker(
                "trainer",
                host,
                [],
                logdir,
                f"trainer-{encoding}",
                extra,
                netns=f"{NETNS_PREFIX}-0" if netns else None,
            )
            self.workers.append(self.trainer)
            self.info = self.trainer.recv(180)
            self.peers = []
            for i in range(n_peers):
                peer_host = f"{NETNS_SUBNET}.{i + 2}" if netns else "127.0.0.1"
                w = Worker(
                    "peer",
                    peer_host,
                    self.info["maddrs"],
                    logdir,
                    f"peer{i}-{encoding}",
                    extra,
                    netns=f"{NETNS_PREFIX}-{i + 1}" if netns else None,
                )
                self.workers.append(w)
                self.peers.append(w)
            for w in self.peers:
                w.recv(180)
                w.ask(dict(cmd="trust", key=self.info["key"]), 60)
        except BaseException:
            self.close()
            raise

    def publish(self, version: int) -> dict[str, Any]:
        return self.trainer.ask(dict(cmd="publish", version=version), 120)

    def uploaded(self) -> int:
        return self.trainer.ask(dict(cmd="stats"), 30)["bytes_served"]

    def fetch(
        self, peers: list[Worker], version: int, serve: bool, timeout: float = 240
    ) -> list[dict[str, Any]]:
        for w in peers:
            w.send(dict(cmd="fetch", version=version, serve=serve, timeout=timeout))
        return [w.recv(timeout + 30) for w in peers]

    def close(self) -> None:
        for w in self.workers:
            try:
                w.send(dict(cmd="quit"))
            except Exception:
                pass
        for w in self.workers:
            w.kill()


def bench_throughput(logdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    swarm = Swarm(1, logdir, args, encoding="fp32")
    try:
        peer = swarm.peers[0]
        rows = []
        for version in range(args.trials):
            pub = swarm.publish(version)
            (res,) = swarm.fetch([peer], version, serve=True)
            assert res["version"] == version, res
            nbytes = pub["bytes"][0]
            bare = peer.ask(dict(cmd="bare", peer_id=swarm.info["peer_id"], bytes=nbytes), 300)["seconds"]
            tcp = peer.ask(dict(cmd="tcp", host="127.0.0.1", port=swarm.info["tcp_port"], bytes=nbytes), 300)[
                "seconds"
            ]
            rows.append(
                dict(
                    bytes=nbytes,
                    fetch_transfer_s=res["transfer_s"],
                    fetch_total_s=res["fetch_s"],
                    bare_stream_s=bare,
                    tcp_s=tcp,
                )
            )
            print(
                f"  {nbytes / MIB:.0f} MiB: fetcher {nbytes / res['transfer_s'] / 1e6:.0f} MB/s "
                f"(end to end {nbytes / res['fetch_s'] / 1e6:.0f} MB/s), bare stream {nbytes / bare / 1e6:.0f} MB/s, "
                f"tcp {nbytes / tcp / 1e6:.0f} MB/s",
                flush=True,
            )
        total = sum(r["bytes"] for r in rows)
        fetch = total / sum(r["fetch_transfer_s"] for r in rows) / 1e6
        bare = total / sum(r["bare_stream_s"] for r in rows) / 1e6
        # each trial measures both paths back to back: the median of their ratios resists the noise of a
        # shared machine better than the ratio of the means
        ratios = sorted(r["bare_stream_s"] / r["fetch_transfer_s"] for r in rows)
        return dict(
            trials=rows,
            fetcher_MBps=fetch,
            fetcher_end_to_end_MBps=total / sum(r["fetch_total_s"] for r in rows) / 1e6,
            bare_stream_MBps=bare,
            tcp_MBps=total / sum(r["tcp_s"] for r in rows) / 1e6,
            ratio_to_bare=ratios[len(ratios) // 2],
            ratio_to_bare_per_trial=ratios,
        )
    finally:
        swarm.close()


def bench_distribution(
    logdir: Path, args: argparse.Namespace, configs: list[tuple[int, bool]], *, netns: bool = False
) -> list[dict[str, Any]]:
    n_max = max(n for n, _ in configs)
    swarm = Swarm(n_max, logdir, args, encoding="int8-delta", netns=netns)
    try:
        pub = swarm.publish(0)  # fp32 keyframe: every peer starts from it (not measured)
        swarm.fetch(swarm.peers, 0, serve=True)
        if netns:
            _netns_limit_trainer(args.rate)
        rows = []
        version = 0
        for n, assist in configs:
            version += 1
            before = swarm.uploaded()
            pub = swarm.publish(version)
            results = swarm.fetch(swarm.peers[:n], version, serve=assist)
            uploaded = swarm.uploaded() - before
            assert all(r["version"] == version for r in results), results
            vbytes = pub["bytes"][0]
            seconds = max(r["applied_at"] for r in results) - pub["published_at"]
            row = dict(
                peers=n,
                assisted=assist,
                version_bytes=vbytes,
                seconds=seconds,
                median_peer_seconds=sorted(r["applied_at"] - pub["published_at"] for r in results)[n // 2],
                trainer_upload_bytes=uploaded,
                trainer_upload_versions=uploaded / vbytes,
                peer_fetch_s=[r["fetch_s"] for r in results],
                peer_transfer_s=[r["transfer_s"] for r in results],
                peer_phases=[r["phases"] for r in results],
                peer_traces=[
                    [(round(t - pub["published_at"], 3), b, n) for t, b, n in r["trace"]] for r in results
                ],
                peer_bytes_by_provider=[r["bytes_by_provider"] for r in results],
                rejected=sum(sum(r["rejected"].values()) for r in results),
                failures=sum(sum(r["failures"].values()) for r in results),
            )
            rows.append(row)
            print(
                f"  {n} peer(s), {'with   ' if assist else 'without'} assistance: {seconds:6.2f} s, trainer upload "
                f"{uploaded / vbytes:.2f} x version ({vbytes / MIB:.1f} MiB)",
                flush=True,
            )
            if (
                n < n_max
            ):  # the others catch up (not measured), so that every peer holds the base of the next delta
                swarm.fetch(swarm.peers[n:], version, serve=True)
        return rows
    finally:
        swarm.close()


# ---- network namespaces -------------------------------------------------------------------------------
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def netns_setup(n_hosts: int) -> None:
    """Namespaces <prefix>-0..n-1 (10.77.0.1..n) with veth links to a bridge in namespace <prefix>-br."""
    br = f"{NETNS_PREFIX}-br"
    _ip("netns", "add", br)
    _ip("-n", br, "link", "add", "br0", "type", "bridge")
    _ip("-n", br, "link", "set", "br0", "up")
    for i in range(n_hosts):
        ns = f"{NETNS_PREFIX}-{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", f"ewb{i}", "netns", br, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("-n", br, "link", "set", f"ewb{i}", "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{NETNS_SUBNET}.{i + 1}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _netns_limit_trainer(rate: str) -> None:
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            f"{NETNS_PREFIX}-0",
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "256kb",
            "latency",
            "100ms",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


def netns_cleanup() -> None:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(NETNS_PREFIX + "-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    probe = f"{NETNS_PREFIX}-probe"
    try:
        _ip("netns", "add", probe)
    except FileNotFoundError:
        return "the 'ip' command is not installed"
    except subprocess.CalledProcessError as exc:
        return f"'ip netns add' is not permitted here ({exc.stderr.decode().strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    try:
        subprocess.run(["tc", "-V"], check=True, capture_output=True, timeout=10)
    except (FileNotFoundError, subprocess.CalledProcessError):
        return "the 'tc' command is not available"
    return None


def bench_netns(logdir: Path, args: argparse.Namespace, configs: list[tuple[int, bool]]) -> dict[str, Any]:
    reason = netns_available()
    if reason is not None:
        print(f"  skipped: {reason}", flush=True)
        return dict(skipped=reason)
    n_max = max(n for n, _ in configs)
    try:
        netns_cleanup()
        netns_setup(n_max + 1)
        rows = bench_distribution(logdir, args, configs, netns=True)
        return dict(rate=args.rate, rows=rows)
    finally:
        netns_cleanup()


# ---- report -------------------------------------------------------------------------------------------
def print_tables(results: dict[str, Any]) -> None:
    if results.get("wire"):
        print("\n(a) bytes on the wire per version")
        print("| model | encoding | MiB/version | x fp32 |")
        print("|---|---|---|---|")
        for r in results["wire"]:
            print(f"| {r['model']} | {r['encoding']} | {r['bytes'] / MIB:.2f} | {r['ratio']:.4f} |")
    t = results.get("throughput")
    if t:
        print("\n(b) fetch throughput from one provider (127.0.0.1)")
        print("| path | MB/s | vs bare stream |")
        print("|---|---|---|")
        print(
            f"| WeightFetcher (transfer + verify) | {t['fetcher_MBps']:.0f} | {t['ratio_to_bare']:.2f} "
            f"(median of trials; range {min(t['ratio_to_bare_per_trial']):.2f}-{max(t['ratio_to_bare_per_trial']):.2f}) |"
        )
        print(
            f"| WeightFetcher end to end (DHT, manifest, apply) | {t['fetcher_end_to_end_MBps']:.0f} | "
            f"{t['fetcher_end_to_end_MBps'] / t['bare_stream_MBps']:.2f} |"
        )
        print(f"| bare hivemind P2P stream | {t['bare_stream_MBps']:.0f} | 1.00 |")
        print(f"| plain TCP | {t['tcp_MBps']:.0f} | {t['tcp_MBps'] / t['bare_stream_MBps']:.2f} |")
    for key, title in (
        ("loopback", "(c) one version to N peers, 127.0.0.1"),
        ("netns", "(d) one version to N peers, namespaces, trainer upload limited"),
    ):
        part = results.get(key)
        if not part:
            continue
        rows = part.get("rows") if isinstance(part, dict) else part
        print(
            f"\n{title}" + (f" ({part.get('rate')})" if isinstance(part, dict) and part.get("rate") else "")
        )
        if not rows:
            print(f"  skipped: {part.get('skipped')}")
            continue
        print("| peers | assistance | seconds (last peer) | median peer s | trainer upload (x version) |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['peers']} | {'yes' if r['assisted'] else 'no'} | {r['seconds']:.2f} | "
                f"{r['median_peer_seconds']:.2f} | {r['trainer_upload_versions']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "results" / "weights.json"), help="JSON results path")
    parser.add_argument(
        "--quick", action="store_true", help="short run: 1M wire sizes, 1 trial, fewer configs"
    )
    parser.add_argument("--model-size", default="30M", help="model of (b)-(d): 1M, 30M or 135M")
    parser.add_argument(
        "--chunk-size", type=int, default=1 * MIB, help="chunk size of the published versions"
    )
    parser.add_argument("--rate", default="100mbit", help="trainer upload limit in (d)")
    parser.add_argument("--parts", nargs="*", default=["a", "b", "c", "d"], help="which parts to run")
    parser.add_argument("--fetcher-config", default="{}", help="FetcherConfig fields as JSON (peers)")
    parser.add_argument("--trials", type=int, default=None, help="(b): trials (default 5, quick 1)")
    # worker mode (internal)
    parser.add_argument("--worker", choices=["trainer", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--encoding", default="int8-delta", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, args.host, args.initial_peer, args)
        return
    args.trials = args.trials or (1 if args.quick else 5)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups (workers, namespaces)
    started = time.perf_counter()
    results: dict[str, Any] = dict(
        settings=dict(
            model_size=args.model_size, chunk_size=args.chunk_size, rate=args.rate, quick=args.quick
        )
    )
    logdir = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    print(f"worker logs in {logdir}", flush=True)
    if "a" in args.parts:
        print("(a) bytes on the wire per version", flush=True)
        sys.path.insert(0, str(HERE))
        import torch
        from weights_codec import bench_wire

        torch.set_num_threads(2)
        results["wire"] = [
            {
                k: v
                for k, v in row.items()
                if k in ("model", "params", "encoding", "bytes", "ratio", "keyframe_bytes")
            }
            for size in (["1M"] if args.quick else [args.model_size])
            for row in bench_wire(size)
        ]
    if "b" in args.parts:
        print(f"(b) throughput from one provider ({args.model_size} fp32 snapshots)", flush=True)
        results["throughput"] = bench_throughput(logdir, args)
    loop_configs = (
        [(1, True), (4, True), (8, True)]
        if args.quick
        else [(1, False), (1, True), (4, False), (4, True), (8, False), (8, True)]
    )
    if "c" in args.parts:
        print("(c) one version to N peers on 127.0.0.1", flush=True)
        results["loopback"] = bench_distribution(logdir, args, loop_configs)
    if "d" in args.parts:
        print(f"(d) one version to N peers in network namespaces, trainer upload {args.rate}", flush=True)
        ns_configs = [(1, True), (8, True)] if args.quick else [(1, True), (8, True), (8, False)]
        results["netns"] = bench_netns(logdir, args, ns_configs)
    results["elapsed_s"] = time.perf_counter() - started
    print_tables(results)
    print(f"\ntotal {results['elapsed_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
