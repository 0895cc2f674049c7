"""An inference peer that fetches one policy version and then serves it (not a pytest module).

Used by ``test_weights_distribution.py`` as a provider that the test can kill with SIGKILL in the middle of
a transfer: it starts a DHT on 127.0.0.1 bootstrapping from ``--initial-peer``, fetches ``--version`` from
the trainer whose OpenSSH key is ``--trusted-key``, serves it with an upload cap of ``--upload-rate`` bytes/s
(slow on purpose), writes its peer id to ``--ready-file`` and serves until SIGTERM or ``--max-seconds``.
With ``--answer-missing`` it misbehaves: its provider record still lists the version as complete, but it
answers every chunk request "missing" (a provider that claims chunks it does not serve); with ``--follow``
it then keeps fetching newer versions and does the same with each (``benchmarks/weights_missing.py``).
With ``--serve-slow`` it serves valid chunks slowly on purpose: ``never`` (not one byte), ``drip`` (64 bytes
every 0.05 s) or ``late`` (each chunk ``--late-seconds`` after its turn, just inside the receivers' old
per-chunk timeout of 30 s by default).
``--stats-file`` receives what it served, as JSON, when it stops. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-id", required=True)
    p.add_argument("--initial-peer", required=True)
    p.add_argument("--trusted-key", required=True, help="the trainer's 'ssh-rsa ...' public key")
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--upload-rate", type=float, default=None, help="bytes/s this provider uploads at most")
    p.add_argument("--ready-file", required=True)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--answer-missing", action="store_true", help="claim every chunk, serve none")
    p.add_argument("--follow", action="store_true", help="keep fetching newer versions")
    p.add_argument(
        "--serve-slow", choices=["never", "drip", "late"], default=None, help="serve valid chunks slowly"
    )
    p.add_argument("--late-seconds", type=float, default=25.0, help="--serve-slow late: seconds per chunk")
    p.add_argument("--stats-file", default=None, help="write the served counters here at the end")
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    from echo_p2p.guard.trust import TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.transport.weights.fetch.config import FetcherConfig
    from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher
    from echo_p2p.transport.weights.service import ServiceLimits

    keys = SwarmKeys(args.run_id)
    identity = load_or_create_identity(None)
    dht = start_dht(
        NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[args.initial_peer]),
        identity,
        [keys],
    )
    config = FetcherConfig(
        request_timeout=5, record_ttl=30, limits=ServiceLimits(upload_rate_limit=args.upload_rate)
    )
    fetcher = WeightFetcher(
        dht, identity, keys, TrustedTrainers.from_keys([args.trusted_key]), config
    ).start()
    try:
        fetcher.ensure_version(args.version, timeout=60)

        def lie(_weights=None) -> None:  # every complete version it holds: listed, never served
            if args.answer_missing:
                for entry in fetcher.endpoint.library.entries():
                    if entry.complete and not isinstance(entry.store, _ClaimingStore):
                        entry.store = _ClaimingStore(entry.store)
                fetcher.announce()

        lie()
        if args.serve_slow:
            servicer = fetcher.endpoint.servicer
            if args.serve_slow == "drip":  # parts of 64 bytes (its own fetch is over: it reads no more parts)
                servicer.limits = servicer.limits.model_copy(update={"part_size": 64})
            pause = {"never": args.max_seconds, "drip": 0.05, "late": args.late_seconds}[args.serve_slow]

            async def slow(nbytes: int) -> None:  # before each part it sends
                await asyncio.sleep(pause)

            servicer._throttle = slow
        fetcher.announce()  # synchronously, so that the test sees this provider once the file exists
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(identity.peer_id)
        os.replace(tmp, args.ready_file)
        if args.follow:
            fetcher.follow(on_update=lie)
        stop.wait(args.max_seconds)
    finally:
        if args.stats_file:
            with open(args.stats_file, "w") as f:
                json.dump(fetcher.endpoint.servicer.stats.as_dict(), f)
        fetcher.shutdown()
        stop_dht(dht)
        identity.cleanup()
    return 0


class _ClaimingStore:
    """A chunk store that says it is complete (so the provider record lists it) and holds nothing."""

    def __init__(self, store):
        self._store = store

    def is_complete(self) -> bool:
        return True

    def has(self, index: int) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._store, name)


if __name__ == "__main__":
    sys.exit(main())
