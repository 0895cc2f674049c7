"""What a Sybil (many keys, one record each) does to the directory: read times as the flood grows.

One key holds one record per directory key (docs/security.md), but keys are cheap. This starts a bootstrap
node and a reader node with echo_p2p's rules on 127.0.0.1, has ``N`` fresh keys each store one valid
``PeerRecord`` (role inference) in a run, and measures, for each ``N``, how long the reader's
``SwarmDirectory.peers()`` takes (median of ``--reads``), how many records it returns, and how long reading
the run's other keys takes (``policies()``, which a flood of peer records does not touch). Each Sybil key
also stores a trainer record under the run's ``trainers`` key, where one trusted trainer announces: the
bootstrap and the reader know the run's trainers (``SwarmDirectory.follow_trust``), the Sybil's own node does
not and serves what it stored, so the ``trainers()`` column is what the pushers, the publisher election and
the fetchers read under the flood. Also the time to make one key (what a Sybil pays per identity).

    .venv/bin/python benchmarks/sybil.py [--sizes 0,100,300,1000] [--reads 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOOP = ["/ip4/127.0.0.1/tcp/0"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="0,100,300,1000")
    p.add_argument("--reads", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "sybil.json"))
    args = p.parse_args(argv)
    sizes = sorted(int(x) for x in args.sizes.split(","))

    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht, visible_maddrs
    from echo_p2p.net.records import PeerRecord

    keys = SwarmKeys("sybil")
    boot_id, reader_id, writer_id, trainer_id = (load_or_create_identity(None) for _ in range(4))
    boot = start_dht(NetworkConfig(host_maddrs=LOOP), boot_id, [keys])
    peers = visible_maddrs(boot)
    reader = start_dht(NetworkConfig(host_maddrs=LOOP, initial_peers=peers), reader_id, [keys])
    writer = start_dht(NetworkConfig(host_maddrs=LOOP, initial_peers=peers), writer_id, [keys])
    directory = SwarmDirectory(reader, keys, reader_id, request_timeout=30)
    trust = RunTrust(fixed=TrustedTrainers.from_keys([trainer_id.peer_id]))
    for dht, ident in ((boot, boot_id), (reader, reader_id)):
        assert SwarmDirectory(dht, keys, ident).follow_trust(trust)
    trainer_record = PeerRecord(peer_id=trainer_id.peer_id, role="trainer").to_wire()
    rows = []
    stored = 0
    keygen = []
    try:
        for size in sizes:
            while stored < size:
                t0 = time.perf_counter()
                ident = load_or_create_identity(None)
                keygen.append(time.perf_counter() - t0)
                record = PeerRecord(peer_id=ident.peer_id, role="inference").to_wire()
                stored += bool(writer.run_coroutine(SignedStore(keys.peers(1, 0), ident.private_key, record)))
                as_trainer = PeerRecord(peer_id=ident.peer_id, role="trainer").to_wire()
                writer.run_coroutine(SignedStore(keys.trainers, ident.private_key, as_trainer))
                ident.cleanup()
            assert boot.run_coroutine(
                SignedStore(keys.trainers, trainer_id.private_key, trainer_record)
            )  # alive
            times, counts = [], []
            for _ in range(args.reads):
                t0 = time.perf_counter()
                counts.append(len(directory.peers()))
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            directory.policies()
            other = time.perf_counter() - t0
            trainer_times, trainer_counts = [], []
            for _ in range(args.reads):
                t0 = time.perf_counter()
                trainer_counts.append(len(directory.trainers()))
                trainer_times.append(time.perf_counter() - t0)
            rows.append(
                {
                    "sybil_keys": size,
                    "records_read": statistics.median(counts),
                    "peers_read_s_median": round(statistics.median(times), 4),
                    "peers_read_s_max": round(max(times), 4),
                    "policy_read_s": round(other, 4),
                    "trainer_records_read": statistics.median(trainer_counts),
                    "trainers_read_s_median": round(statistics.median(trainer_times), 4),
                    "trainers_read_s_max": round(max(trainer_times), 4),
                }
            )
            print(rows[-1], flush=True)
    finally:
        for dht in (writer, reader, boot):
            stop_dht(dht)
        for ident in (boot_id, reader_id, writer_id, trainer_id):
            ident.cleanup()
    print(
        f"\n{'keys':>6} {'read':>6} {'peers() s':>10} {'max s':>7} {'policy s':>9} {'trainers':>9} {'trainers() s':>13}"
    )
    for r in rows:
        print(
            f"{r['sybil_keys']:>6} {r['records_read']:>6.0f} {r['peers_read_s_median']:>10.3f} "
            f"{r['peers_read_s_max']:>7.3f} {r['policy_read_s']:>9.3f} {r['trainer_records_read']:>9.0f} "
            f"{r['trainers_read_s_median']:>13.3f}"
        )
    keygen_s = statistics.median(keygen) if keygen else None
    print(f"one key: {keygen_s:.3f} s" if keygen_s else "")
    out = {
        "benchmark": "sybil",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "keygen_s_median": keygen_s,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


class SignedStore:
    """Runs in the writer's DHT process: stores ``record`` under ``key`` signed by ``private_key`` (a Sybil
    identity). The node's signature validator is made to sign each record with the key whose public key the
    record names (``_SignWithNamedKey``), so that many such stores may be in flight at once."""

    def __init__(self, key: str, private_key, record) -> None:
        self.key, self.private_key, self.record = key, private_key, record

    async def __call__(self, _dht, node) -> bool:
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils import get_dht_time

        validator = next(
            v for v in node.protocol.record_validator._validators if isinstance(v, RSASignatureValidator)
        )
        if not isinstance(validator, _SignWithNamedKey):
            validator.__class__ = _sign_with_named_key_class()
            validator.sybil_keys = {}
        marker = RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(
            b"_key_", self.private_key.get_public_key().to_bytes()
        )
        validator.sybil_keys[marker] = self.private_key
        return bool(await node.store(self.key, self.record, get_dht_time() + 600, subkey=marker))


class _SignWithNamedKey:
    """Marker base of the validator class ``_sign_with_named_key_class`` makes (hivemind imported lazily)."""


def _sign_with_named_key_class():
    from hivemind.dht.crypto import RSASignatureValidator

    global _SIGNER_CLASS
    if _SIGNER_CLASS is None:

        class SignWithNamedKey(RSASignatureValidator, _SignWithNamedKey):
            """Signs a record with the Sybil key its key or subkey names, else as the node's own validator."""

            sybil_keys: dict

            def sign_value(self, record):
                named = self._PUBLIC_KEY_RE.findall(record.key) + self._PUBLIC_KEY_RE.findall(
                    record.subkey or b""
                )
                for public_key in named:
                    private_key = self.sybil_keys.get(self.PUBLIC_KEY_FORMAT.replace(b"_key_", public_key))
                    if private_key is not None:
                        signature = private_key.sign(self._serialize_record(record))
                        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)
                return super().sign_value(record)

        _SIGNER_CLASS = SignWithNamedKey
    return _SIGNER_CLASS


_SIGNER_CLASS = None


if __name__ == "__main__":
    main()
