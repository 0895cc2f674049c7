"""Benchmark: what a provider that claims chunks it does not serve costs a receiver that follows a run.

A trainer (``WeightPublisher``, in this process) publishes ``--versions`` fp32 keyframes of a 1 MiB tensor
set (16 chunks of 64 KiB each); a receiver (``WeightFetcher``, in this process, fresh) fetches each one.
Run twice: alone, then with a liar (``tests/integration/weights_provider_proc.py --answer-missing --follow``,
its own process group) that fetches every version first and then lists it as complete in its provider
record while answering every chunk request "missing". Before each timed fetch the liar's record lists the
version (so the receiver always sees the claim). Reported: the receiver's fetch seconds per version, chunk
streams the liar was asked for (its own servicer counters), the receiver's ``claimed_missing`` refusals and
bans. Goal: with the liar, fetches within 1.5x of alone after the first version, and the liar asked a
bounded number of times in total (``max_missing_answers`` + the streams already open).

Run: ``python benchmarks/weights_missing.py [--versions 10] [--out PATH]`` (~1 min on 2 CPU cores). Every
wait is bounded; the liar's process group is killed by group id at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from echo_p2p.guard.trust import TrustedTrainers
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.keys import SwarmKeys
from echo_p2p.net.network_config import NetworkConfig
from echo_p2p.net.node import start_dht, stop_dht, visible_maddrs
from echo_p2p.transport.weights.fetch.config import FetcherConfig
from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher
from echo_p2p.transport.weights.publisher import PublisherConfig, WeightPublisher
from echo_p2p.weights.config import EncodingConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dht import stop  # noqa: E402 (a sibling script: stops a process group by its id)

LIAR = HERE.parent / "tests" / "integration" / "weights_provider_proc.py"
LOOP = ["/ip4/127.0.0.1/tcp/0"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def tensors_of(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [("layer.weight", torch.randn(512, 512, generator=gen))]  # 1 MiB fp32: 16 chunks of 64 KiB


def run(versions: int, with_liar: bool, workdir: Path) -> dict:
    keys = SwarmKeys(f"bench-missing-{int(with_liar)}")
    identities, dhts, closers, liar = [], [], [], None

    def node(initial: list[str]):
        identity = load_or_create_identity(None)
        identities.append(identity)
        dhts.append(start_dht(NetworkConfig(host_maddrs=LOOP, initial_peers=initial), identity, [keys]))
        return identity, dhts[-1]

    try:
        trainer_id, trainer_dht = node([])
        maddrs = visible_maddrs(trainer_dht)
        encoding = EncodingConfig(encoding="fp32", chunk_size=64 * 1024)
        publisher = WeightPublisher(trainer_dht, trainer_id, keys, PublisherConfig(encoding=encoding)).start()
        closers.append(publisher.shutdown)
        publisher.publish(tensors_of(0), 0)
        stats_file = workdir / f"liar-{int(with_liar)}.json"
        if with_liar:
            ready = workdir / "liar.ready"
            liar = subprocess.Popen(
                [sys.executable, str(LIAR), "--run-id", keys.run_id, "--initial-peer", maddrs[0],
                 "--trusted-key", trainer_id.public_key_bytes().decode(), "--version", "0",
                 "--ready-file", str(ready), "--answer-missing", "--follow", "--stats-file", str(stats_file),
                 "--max-seconds", "600"],
                stdout=open(workdir / "liar.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            wait_until(lambda: ready.exists() or liar.poll() is not None, 90, "the liar to start")
            assert liar.poll() is None, (workdir / "liar.log").read_text()
        receiver_id, receiver_dht = node(maddrs)
        trusted = TrustedTrainers.from_keys([trainer_id.public_key_bytes()])
        config = FetcherConfig(request_timeout=5.0, provider_refresh=0.3, have_period=0.1)
        receiver = WeightFetcher(receiver_dht, receiver_id, keys, trusted, config).start()
        closers.append(receiver.shutdown)
        seconds, phases = [], []
        for version in range(versions):
            if version:
                publisher.publish(tensors_of(version), version)
            digest = publisher.record.manifests[-1].digest
            if with_liar:  # the liar lists this version before the receiver looks for providers
                wait_until(
                    lambda d=digest, v=version: any(
                        d in e.record.manifests for e in receiver.directory.providers(v)
                    ),
                    60,
                    f"the liar to list version {version}",
                )
            t0 = time.monotonic()
            weights = receiver.ensure_version(version, timeout=120)
            seconds.append(time.monotonic() - t0)
            phases.append({k: round(v, 3) for k, v in receiver.stats.last_phases.items()})
            assert weights is not None and weights.version == version
        stats = receiver.stats_dict()
    finally:
        if liar is not None:
            stop(liar)  # SIGTERM, then SIGKILL to whatever is left of its group (p2pd, DHT child)
        for close in reversed(closers):
            close()
        for dht in dhts:
            stop_dht(dht)
        for identity in identities:
            identity.cleanup()
    served = json.loads(stats_file.read_text()) if with_liar and stats_file.exists() else None
    return {
        "fetch_seconds": [round(s, 3) for s in seconds],
        "median_after_first": round(statistics.median(seconds[1:] or seconds), 3),
        "total_seconds": round(sum(seconds), 3),
        "liar_streams": None if served is None else served["streams"],
        "claimed_missing": stats["rejected"].get("claimed_missing", 0),
        "banned": stats["banned"],
        "failures": stats["failures"],
        "phases": phases,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=10)
    p.add_argument("--out", default=str(HERE / "results" / "weights_missing.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        alone = run(args.versions, False, Path(tmp))
        print("alone:", json.dumps(alone), flush=True)
        liar = run(args.versions, True, Path(tmp))
        print("with liar:", json.dumps(liar), flush=True)
    result = {
        "when": time.strftime("%Y-%m-%d"),
        "versions": args.versions,
        "alone": alone,
        "with_liar": liar,
        "slowdown_median_after_first": round(liar["median_after_first"] / alone["median_after_first"], 2),
        "slowdown_total": round(liar["total_seconds"] / alone["total_seconds"], 2),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("slowdown")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
