"""Records and bytes each directory reader of a run reads per read, at N inference peers and K buckets.

Counts what ``SwarmDirectory`` itself counts (``keys_read``, ``records_read``) for each reader as a run calls
it: the sync trainer's and peer cache's ``peer_sample``, a weight fetcher's ``providers(version)``, and one
``swarm status``/monitor poll (``BucketSampler``); "flat" is the layout before buckets (every reader read
every record of ``peers`` or ``providers``). The store is in memory with hivemind's ``get`` shape, filled
with N honest-sized records (~1.1 KB, as measured in docs/scaling.md) under the keys their peer ids hash
to: no network, so this is the read *size* of each reader, not its latency (that needs real DHT nodes).
Records carry synthetic peer ids and subkeys (no 10,000 RSA keys to make), so the benchmark's directory
skips the one check that needs a real key (subkey owner = peer id); everything else is the shipped path.

    .venv/bin/python benchmarks/directory_reads.py [--peers 1000 10000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import Future
from pathlib import Path


class MemoryDht:
    """``get`` of hivemind's DHT over a dict, and the bytes its answers would carry."""

    def __init__(self, data: dict):
        self.data = data
        self.bytes = 0

    def get(self, key, latest, return_future):
        import msgpack
        from hivemind.utils import ValueWithExpiration, get_dht_time

        found = self.data.get(key)
        if found is not None:
            self.bytes += sum(len(msgpack.packb(v.value, use_bin_type=True)) + 400 for v in found.values())
        future = Future()
        future.set_result(None if found is None else ValueWithExpiration(found, get_dht_time() + 60))
        return future


def fill(n: int, k: int, version: int) -> dict:
    from hivemind.utils import ValueWithExpiration, get_dht_time

    from echo_p2p.net.buckets import bucket_of
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.records import PeerRecord, ProviderRecord

    keys, exp, data = SwarmKeys("bench"), get_dht_time() + 300, {}
    for i in range(n):
        peer_id = f"Qm{i:044d}"
        maddrs = [f"/ip4/203.0.113.{i % 250}/tcp/31337/p2p/{peer_id}", f"/ip4/10.0.0.{i % 250}/tcp/31337"]
        peer = PeerRecord(
            peer_id=peer_id, role="inference", mode="async", policy_version=version, maddrs=maddrs
        )
        provider = ProviderRecord(
            peer_id=peer_id, versions=[version - 1, version], maddrs=maddrs, manifests=["a" * 64] * 4
        )
        subkey = b"[owner:ssh-rsa " + b"A" * 372 + b"%d]" % i  # an RSA-2048 marker's length
        b = bucket_of(peer_id, k)
        data.setdefault(keys.peers(k, b), {})[subkey] = ValueWithExpiration(peer.to_wire(), exp)
        data.setdefault(keys.providers(k, b, version), {})[subkey] = ValueWithExpiration(
            provider.to_wire(), exp
        )
    return data


def measure(n: int, k: int) -> dict:
    from echo_p2p.monitor.sampling import BucketSampler
    from echo_p2p.net.directory import SwarmDirectory

    class SyntheticKeys(SwarmDirectory):
        def _parse(self, subkey, value, cls):
            return cls.from_wire(value)  # synthetic subkeys: no owner key to match the peer id against

    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys

    version = 7
    dht = MemoryDht(fill(n, k, version))
    me = load_or_create_identity(None)
    rows = {}
    readers = {
        "sync trainer / peer cache (peer_sample)": lambda d: d.peer_sample(),
        "weight fetcher (providers of its version)": lambda d: d.providers(version),
        "swarm status / monitor poll": lambda d: BucketSampler().poll(d),
    }
    try:
        for name, read in readers.items():
            directory = SyntheticKeys(dht, SwarmKeys("bench"), me, buckets=k)
            dht.bytes = 0
            t0 = time.perf_counter()
            read(directory)
            rows[name] = {
                "keys": directory.keys_read,
                "records": directory.records_read,
                "kbytes": round(dht.bytes / 1024, 1),
                "parse_s": round(time.perf_counter() - t0, 3),
            }
    finally:
        me.cleanup()
    return rows


def main() -> None:
    from echo_p2p.net.buckets import buckets_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--out", default="benchmarks/results/directory_reads.json")
    args = parser.parse_args()
    results = []
    for n in args.peers:
        for k in sorted({1, buckets_for(n)}):
            for reader, row in measure(n, k).items():
                results.append({"peers": n, "buckets": k, "reader": reader, **row})
                print(
                    f"N={n:>6} K={k:>3} {reader:<45} keys {row['keys']:>3} records {row['records']:>6} "
                    f"{row['kbytes']:>8} KB  parse {row['parse_s']} s"
                )
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
