"""Start-up times and DHT latency on loopback: what joining a run costs.

Measures, in one run on this machine:
- ``--help`` of the peer CLI (must not import torch or hivemind),
- a bootstrap process from launch to "ready" (its multiaddrs file written),
- a peer process from launch to "joined run" (DHT up, first record announced),
- directory store / get latency between in-process DHT nodes on 127.0.0.1 (median and p95 of N calls).
Prints a table and writes JSON (default ``benchmarks/results/dht.json``).

    .venv/bin/python benchmarks/dht.py [--repeats 3] [--calls 200] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _wait_for(predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.01)
    raise TimeoutError


def time_help() -> float:
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "echo_p2p.peer", "--help"], capture_output=True, check=True, timeout=60
    )
    return time.monotonic() - t0


def start_bootstrap(workdir: Path) -> tuple[subprocess.Popen, str, float]:
    maddrs = workdir / f"boot-{time.monotonic_ns()}.maddrs"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "echo_p2p.bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _wait_for(maddrs.exists, 60)
    return proc, maddrs.read_text().split()[0], time.monotonic() - t0


def time_peer(maddr: str, workdir: Path) -> float:
    log = workdir / f"peer-{time.monotonic_ns()}.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "echo_p2p.peer",
                "--role",
                "inference",
                "--run-id",
                "bench",
                "--initial-peers",
                maddr,
                "--host-maddrs",
                LOOPBACK,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_for(lambda: b"joined run" in log.read_bytes(), 60)
            return time.monotonic() - t0
        finally:
            stop(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def dht_latency(maddr: str, calls: int) -> dict[str, float]:
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.net.records import PeerRecord

    keys = SwarmKeys("bench")
    nodes = []
    try:
        for _ in range(2):
            ident = load_or_create_identity(None)
            dht = start_dht(NetworkConfig(initial_peers=[maddr], host_maddrs=[LOOPBACK]), ident, [keys])
            nodes.append((dht, ident, SwarmDirectory(dht, keys, ident)))
        (_, writer_id, writer), (_, _, reader) = nodes
        stores, gets = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            writer.announce(PeerRecord(peer_id=writer_id.peer_id, role="inference"), ttl=30)
            stores.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert reader.peers()
            gets.append(time.perf_counter() - t0)
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
        return {
            "store_median_ms": 1e3 * statistics.median(stores),
            "store_p95_ms": 1e3 * q(stores, 0.95),
            "get_median_ms": 1e3 * statistics.median(gets),
            "get_p95_ms": 1e3 * q(gets, 0.95),
        }
    finally:
        for dht, ident, _ in nodes:
            stop_dht(dht)
            ident.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/dht.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        helps = [time_help() for _ in range(args.repeats)]
        boots, peers = [], []
        boot = None
        for i in range(args.repeats):
            proc, maddr, seconds = start_bootstrap(workdir)
            boots.append(seconds)
            if i < args.repeats - 1:
                stop(proc)
            else:
                boot = (proc, maddr)
        try:
            peers = [time_peer(boot[1], workdir) for _ in range(args.repeats)]
            latency = dht_latency(boot[1], args.calls)
        finally:
            stop(boot[0])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "peer_help_s": statistics.median(helps),
        "bootstrap_start_s": statistics.median(boots),
        "peer_join_s": statistics.median(peers),
        **latency,
    }
    rows = [
        ("peer --help", f"{result['peer_help_s']:.2f} s"),
        ("bootstrap launch -> ready", f"{result['bootstrap_start_s']:.2f} s"),
        ("peer launch -> joined run", f"{result['peer_join_s']:.2f} s"),
        (
            "DHT store (signed record)",
            f"{result['store_median_ms']:.1f} ms median, {result['store_p95_ms']:.1f} ms p95",
        ),
        (
            "DHT get (peer list)",
            f"{result['get_median_ms']:.1f} ms median, {result['get_p95_ms']:.1f} ms p95",
        ),
    ]
    print(f"echo_p2p start-up and DHT latency on loopback ({result['machine']}, medians of {args.repeats})")
    for name, value in rows:
        print(f"  {name:<28} {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
