"""The tiny-model swarm on an emulated internet vs on loopback, side by side in one run.

Arms (each a fresh swarm: bootstrap, one async trainer, ``--peers`` inference peers; tiny model, ``count``):

* ``loopback``: every process on 127.0.0.1, as ``echo_p2p.local`` runs them;
* ``nat``: the bootstrap and the trainer on a public segment, each inference peer at home behind its own NAT
  router (nftables masquerade, no port forward) with a ``--uplink`` Mbit/s uplink and a ``--downlink`` Mbit/s
  downlink (``tests/netlab.py``; needs root). Home peers find out they are unreachable, reserve a relay slot
  on the bootstrap and serve chunks to each other through it.

Figures over the last ``--window`` seconds of each arm (from the peers' own metrics, every 2 s): rollout
groups consumed per second, trainer idle share, versions per second, the bytes the trainer uploads per
version it published, the inference peers' mean version lag behind the trainer, the share of weight bytes
they got from other inference peers (peer-assisted distribution) and their reachability. In the ``nat`` arm,
also what each kind of host sent into the network per version (its interface counter: weights, DHT, acks
and, on the bootstrap, the home peers' relayed traffic): ``bootstrap_``, ``trainer_`` and ``home_host_bytes_
per_version`` (a home host's is the mean over the home hosts).

The tiny model's versions are ~0.1 MiB, far below what a 20 Mbit/s link carries per version: this measures
that NAT traversal costs the loop nothing, not how a large model's versions spread over home links
(docs/scaling.md has those figures from ``benchmarks/weights.py``).

``--hidden H --layers L`` runs a random-init policy of that size instead (the tiny preset's architecture
and tokenizer, wider and deeper), whose versions are large enough to load the home links.

Run (root): ``python benchmarks/wan.py [--peers 2] [--seconds 70] [--window 40] [--hidden 256 --layers 4]
[--out benchmarks/results/wan.json]`` (about 3 minutes). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import LOOPBACK, LabProcs, Procs, write_run_record  # noqa: E402
from tests.netlab import NetLab, skip_reason  # noqa: E402

RUN = "wanbench"


def wide_policy(hidden: int, layers: int, directory: Path) -> Path:
    """A random-init policy like the tiny preset but ``hidden`` wide and ``layers`` deep, saved where
    ``--model-path`` loads it (its versions are what ``--hidden`` makes them: 2 bytes per parameter)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from echo_p2p.ml.models import TINY_ARCH, save_policy
    from echo_p2p.ml.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    arch = {**TINY_ARCH, "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 4 * hidden}
    arch.update(num_attention_heads=max(4, hidden // 64), head_dim=min(64, hidden // 4))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **arch,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return save_policy(model.eval(), tokenizer, directory)


def run_arm(name: str, args: argparse.Namespace, workdir: Path, model_path: Path | None) -> dict[str, Any]:
    from echo_p2p.net.identity import load_or_create_identity

    workdir.mkdir(parents=True)
    metrics = workdir / "metrics"
    config = workdir / "peer.yaml"
    config.write_text("metrics_period: 2\n")
    owner = load_or_create_identity(str(workdir / "owner.id"))
    trainer_id = load_or_create_identity(str(workdir / "trainer.id"))
    model = model_path.name if model_path else "tiny"
    record = write_run_record(workdir / "run.bin", RUN, owner, [trainer_id.peer_id], model=model)
    lab = NetLab().__enter__() if name == "nat" else None
    procs = LabProcs(workdir, lab, args.uplink, args.downlink) if lab is not None else Procs(workdir)
    try:
        _, boot = procs.bootstrap("--run-record", str(record))
        common = ["--config", str(config), "--metrics-dir", str(metrics), "--threads", "1"]
        common += ["--heartbeat-period", "2", *(["--model-path", str(model_path)] if model_path else [])]
        procs.peer(
            "trainer", RUN, boot, "--run-record", str(record), "--identity-path", trainer_id.path, *common
        )
        for i in range(args.peers):
            procs.start(
                "-m", "echo_p2p.peer", "--role", "inference", "--join", f"{RUN}:{owner.peer_id}@{boot}",
                "--host-maddrs", LOOPBACK, "--seed", str(i), *common, name="inference",
            )  # fmt: skip
        started = time.time()
        time.sleep(args.seconds - args.window)
        before = host_bytes(procs)
        time.sleep(args.window)
        out = summarize(metrics, started + args.seconds - args.window, started + args.seconds)
        sent = {k: v - before[k] for k, v in host_bytes(procs).items()}
        versions = out["versions_per_s"] * args.window
        for kind in ("bootstrap", "trainer", "home"):
            mine = [v for k, v in sent.items() if k.startswith(kind)]
            per_version = sum(mine) / len(mine) / versions if mine and versions > 0 else None
            out[f"{kind}_host_bytes_per_version"] = per_version
        return out
    finally:
        procs.cleanup()
        if lab is not None:
            lab.close()


def host_bytes(procs) -> dict[str, int]:
    """Bytes each lab host has sent so far, by host name (empty on loopback: no host of its own)."""
    if not isinstance(procs, LabProcs):
        return {}
    return {host.name: procs.lab.sent_bytes(host) for host in procs.hosts.values()}


def lines(path: Path, start: float, end: float) -> list[dict]:
    out = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in out if start <= x["time"] <= end]


def summarize(metrics: Path, start: float, end: float) -> dict[str, Any]:
    trainer = [x for p in metrics.glob("trainer-*.jsonl") for x in lines(p, start, end)]
    status = [x for x in trainer if "idle_fraction" in x]
    if len(status) < 2:
        raise RuntimeError("the trainer wrote fewer than two status lines in the window")
    first, last = status[0], status[-1]
    span = max(1e-9, last["time"] - first["time"])
    out: dict[str, Any] = {
        "consumed_per_s": (last["rollouts_consumed"] - first["rollouts_consumed"]) / span,
        "versions_per_s": ((last["version"] or 0) - (first["version"] or 0)) / span,
        "idle_fraction": last["idle_fraction"],
        "trainer_bytes_per_version": last.get("bytes_uploaded_per_version"),
    }
    lags, from_peers, total, reach = [], 0, 0, set()
    for path in metrics.glob("inference-*.jsonl"):
        mine = lines(path, start, end)
        if not mine:
            continue
        lags += [x["version_lag"] for x in mine if x.get("version_lag") is not None]
        reach.add(mine[-1].get("reachability"))
        by = mine[-1]["weights"]["bytes_by_provider"]
        total += sum(by.values())
        from_peers += sum(v for k, v in by.items() if k not in {x["peer_id"] for x in status})
    out["version_lag_mean"] = sum(lags) / len(lags) if lags else None
    out["bytes_from_peers_share"] = from_peers / total if total else None
    out["reachability"] = sorted(r for r in reach if r)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2, help="inference peers")
    parser.add_argument("--seconds", type=float, default=70.0, help="length of each arm")
    parser.add_argument("--window", type=float, default=40.0, help="measured window at the end of each arm")
    parser.add_argument("--uplink", type=float, default=20.0, help="home uplink (Mbit/s)")
    parser.add_argument("--downlink", type=float, default=100.0, help="home downlink (Mbit/s)")
    parser.add_argument(
        "--hidden", type=int, default=None, help="a random-init policy this wide instead of the tiny preset"
    )
    parser.add_argument("--layers", type=int, default=4, help="its depth (with --hidden)")
    parser.add_argument("--out", default=str(HERE / "results" / "wan.json"))
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        sys.exit(f"cannot run the nat arm: {reason}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="echo-wan-") as tmp:
        model_path = None
        if args.hidden:
            model_path = wide_policy(
                args.hidden, args.layers, Path(tmp) / f"wide-{args.hidden}x{args.layers}"
            )
        for arm in ("loopback", "nat"):
            print(f"running the {arm} arm ({args.seconds:.0f} s)...", flush=True)
            results[arm] = run_arm(arm, args, Path(tmp) / arm, model_path)
    keys = ["consumed_per_s", "versions_per_s", "idle_fraction", "trainer_bytes_per_version"]
    keys += ["version_lag_mean", "bytes_from_peers_share", "reachability"]
    keys += [f"{kind}_host_bytes_per_version" for kind in ("bootstrap", "trainer", "home")]
    print(f"\n{'figure':28s} {'loopback':>14s} {'nat':>14s} {'nat / loopback':>15s}")
    for key in keys:
        a, b = results["loopback"].get(key), results["nat"].get(key)
        ratio = f"{b / a:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "-"
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
        print(f"{key:28s} {fmt(a):>14s} {fmt(b):>14s} {ratio:>15s}")
    report = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},  # not this machine's path
        "arms": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
