"""A trainer process for the collaborative-optimizer tests and measurements (not a pytest module).

Starts a DHT on 127.0.0.1 (``start_dht`` with an ephemeral identity, bootstrapping from ``--initial-peer``
when given), builds the tiny policy (same seed on every trainer) and a ``hivemind.Optimizer`` through
``make_collab_optimizer``, then trains on the ``count`` task with rollouts it samples itself from
``--data-seed`` (so two trainers see different data) until its optimizer epoch reaches ``--until-epoch``.
``--join-file`` holds a late trainer back (imports done, model built) before it joins the DHT, and
``--start-file`` holds training back until the test has every trainer up; from ``--idle-from-epoch`` on it
samples nothing and only joins the others' gradient rounds, or downloads their state when out of sync with
them (``CollabTrainerStep.catch_up``), as a trainer peer with no batch does (``TrainerPeer.work``). Once at the target epoch and
in sync with the other trainers (``CollabTrainerStep.in_sync``: it goes on training until its last epoch
was agreed, or its state downloaded), it waits for any background state averaging to land, writes ``--result`` (epoch, peer id and per-step timings as
JSON; parameters in ``<result>.pt``, both atomically) and keeps its averagers serving state until
``--hold-file`` appears or ``--hold-seconds`` pass, so a late trainer can load state from it. Every wait is
bounded; SIGTERM shuts the optimizer and the DHT down. The per-step timings (``compute_s``,
``optimizer_s``, epoch before/after, peers seen) are what the epoch-overhead figures in
``echo_p2p/collab/optimizer.py`` were computed from.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-id", required=True)
    p.add_argument("--initial-peer", default=None, help="multiaddr of a running trainer to bootstrap from")
    p.add_argument("--maddrs-file", default=None, help="write this node's multiaddrs here once it is up")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--model-seed", type=int, default=0)
    p.add_argument("--until-epoch", type=int, default=3)
    p.add_argument("--prompts-per-step", type=int, default=4, help="rollout groups per local step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--target-batch-size", type=int, default=8, help="groups per epoch, all trainers")
    p.add_argument("--matchmaking-time", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--result", required=True, help="JSON result; parameters go to <result>.pt")
    p.add_argument("--join-file", default=None, help="wait (bounded) for this file before joining the DHT")
    p.add_argument("--ready-file", default=None, help="created once the optimizer is built")
    p.add_argument("--start-file", default=None, help="wait (bounded) for this file before training")
    p.add_argument("--hold-file", default=None, help="after the result, serve state until this file exists")
    p.add_argument("--hold-seconds", type=float, default=60.0)
    p.add_argument("--max-seconds", type=float, default=60.0, help="give up training after this long")
    p.add_argument("--step-pause", type=float, default=0.0, help="sleep between local steps (seconds)")
    p.add_argument(
        "--idle-from-epoch",
        type=int,
        default=None,
        help="from this epoch on, sample and train nothing: only join the others' gradient rounds as a trainer "
        "with no batch does (CollabTrainerStep.join_round_while_idle)",
    )
    p.add_argument("--verbose", action="store_true", help="log hivemind's optimizer events (INFO)")
    return p.parse_args(argv)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _wait_for(path: str | None, stop: threading.Event, timeout: float = 90.0) -> bool:
    """True once ``path`` exists (or when no path is given); False on timeout or SIGTERM."""
    deadline = time.monotonic() + timeout
    while path and not Path(path).exists():
        if stop.is_set() or time.monotonic() > deadline:
            return False
        stop.wait(0.05)
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    import torch

    torch.set_num_threads(1)
    from echo_p2p.collab.optimizer import (
        CollabOptimizerConfig,
        CollabTrainerStep,
        make_collab_optimizer,
        shutdown_optimizer,
    )
    from echo_p2p.ml.engine import SamplingParams, TransformersEngine
    from echo_p2p.ml.models import build_tiny_policy
    from echo_p2p.ml.tokenizer import decode_completion, encode_prompts
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht, visible_maddrs
    from echo_p2p.rollout import Completion, RolloutGroup
    from echo_p2p.tasks.registry import build_task
    from echo_p2p.train.config import DerivedSettings, GRPOConfig, OptimizerConfig
    from echo_p2p.train.learner import Learner
    from echo_p2p.train.scored import ScoredGroup

    model, tokenizer = build_tiny_policy(args.model_seed)
    if not _wait_for(args.join_file, stop):
        print("join file never appeared", flush=True)
        return 3
    t_start = time.monotonic()
    identity = load_or_create_identity(None)
    network = NetworkConfig(
        initial_peers=[args.initial_peer] if args.initial_peer else [],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        startup_timeout=30,
    )
    dht = start_dht(network, identity, [SwarmKeys(args.run_id)])
    if args.maddrs_file:
        _write_atomic(Path(args.maddrs_file), "\n".join(visible_maddrs(dht)).encode())

    grpo = GRPOConfig(micro_batch_size=64)
    learner = Learner(model, grpo, derived=DerivedSettings(pad_token_id=tokenizer.pad_token_id))
    config = CollabOptimizerConfig(
        target_batch_size=args.target_batch_size,
        matchmaking_time=args.matchmaking_time,
        request_timeout=min(0.5, args.matchmaking_time / 2),
        progress_refresh_max=1.0,
        verbose=args.verbose,
    )
    opt = make_collab_optimizer(
        dht,
        args.run_id,
        model.parameters(),
        config,
        OptimizerConfig(lr=args.lr),
        private_key=identity.private_key,
    )
    trainer = CollabTrainerStep(learner, opt)
    task = build_task("count")
    engine = TransformersEngine(model, tokenizer)
    rng = random.Random(args.data_seed)
    steps: list[dict] = []
    agreed: dict[int, dict[str, torch.Tensor]] = {}  # epoch -> parameters right after an agreed transition
    print(f"ready in {time.monotonic() - t_start:.1f}s", flush=True)
    if args.ready_file:
        _write_atomic(Path(args.ready_file), identity.peer_id.encode())

    try:
        if not _wait_for(args.start_file, stop):
            print("start file never appeared", flush=True)
            return 3
        deadline = time.monotonic() + args.max_seconds
        step = 0
        # Past the target epoch, go on until the last transition was agreed with the group (or the state was
        # downloaded): after a failed round the optimizer re-synchronises within the next step or epoch.
        while (trainer.version < args.until_epoch or not trainer.in_sync) and not stop.is_set():
            if time.monotonic() > deadline:
                print(f"gave up at epoch {trainer.version}", flush=True)
                return 2
            if args.idle_from_epoch is not None and trainer.version >= args.idle_from_epoch:
                before, agreed_before = trainer.version, opt.sync_stats["agreed"]
                t0 = time.perf_counter()
                joined = trainer.join_round_while_idle()
                if (
                    joined
                    and opt.sync_stats["agreed"] > agreed_before
                    and trainer.version >= args.until_epoch - 1
                ):
                    agreed[trainer.version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                # not joined: its last round failed or came back partial, or it is behind: download
                if joined or trainer.catch_up():
                    steps.append(
                        dict(
                            t=time.monotonic(),
                            before=before,
                            after=trainer.version,
                            idle=True,
                            caught_up=not joined,
                            optimizer_s=time.perf_counter() - t0,
                            peers=opt.tracker.global_progress.num_peers,
                            in_sync=trainer.in_sync,
                        )
                    )
                    how = "joined a round" if joined else "downloaded"
                    print(
                        f"idle, {how}: epoch {before}->{trainer.version} in_sync {trainer.in_sync}",
                        flush=True,
                    )
                else:
                    stop.wait(0.05)
                continue
            ids = task.sample_prompt_ids(rng, args.prompts_per_step)
            prompts = encode_prompts(tokenizer, [task.prompt(i) for i in ids], use_chat_template=False)
            params = SamplingParams(
                temperature=1.0, max_new_tokens=task.max_new_tokens, seed=args.data_seed * 100_000 + step
            )
            t0 = time.perf_counter()
            samples = engine.sample(prompts, args.group_size, params)
            sample_s = time.perf_counter() - t0
            groups = []
            for pid, prompt, group in zip(ids, prompts, samples, strict=True):
                texts = [decode_completion(tokenizer, s.token_ids) for s in group]
                rewards = task.score_batch(
                    [pid] * len(texts), texts, completion_ids=[s.token_ids for s in group]
                )
                comps = [
                    Completion(token_ids=s.token_ids, logprobs=s.logprobs, claimed_reward=r)
                    for s, r in zip(group, rewards, strict=True)
                ]
                rg = RolloutGroup(
                    task="count",
                    prompt_id=pid,
                    prompt_token_ids=prompt,
                    completions=comps,
                    policy_version=trainer.version,
                )
                groups.append(ScoredGroup(rg, rewards))
            agreed_before = opt.sync_stats["agreed"]
            res = trainer(groups)
            if opt.sync_stats["agreed"] > agreed_before and res.version >= args.until_epoch - 1:
                # the state right after an epoch agreed with the group: the test compares trainers there when
                # they stopped at different epochs (a round that came back partial for one of them)
                trainer.settle()
                agreed[res.version] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            steps.append(
                dict(
                    t=time.monotonic(),
                    before=res.version_before,
                    after=res.version,
                    sample_s=sample_s,
                    compute_s=res.compute_s,
                    optimizer_s=res.optimizer_s,
                    reward=res.stats["reward_mean"],
                    peers=opt.tracker.global_progress.num_peers,
                    in_sync=trainer.in_sync,
                )
            )
            print(
                f"step {step}: epoch {res.version_before}->{res.version} compute {res.compute_s:.3f}s "
                f"opt {res.optimizer_s:.3f}s reward {res.stats['reward_mean']:.3f} in_sync {trainer.in_sync}",
                flush=True,
            )
            step += 1
            if args.step_pause:
                time.sleep(args.step_pause)

        trainer.settle()
        result = Path(args.result)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        tmp_pt = result.with_name(result.name + ".pt.tmp")
        torch.save({"epoch": trainer.version, "state": state, "agreed": agreed}, tmp_pt)
        os.replace(tmp_pt, result.with_name(result.name + ".pt"))
        _write_atomic(
            result,
            json.dumps(
                dict(
                    epoch=trainer.version,
                    steps=steps,
                    peer_id=identity.peer_id,
                    sync=opt.sync_stats,
                    agreed_epochs=sorted(agreed),
                )
            ).encode(),
        )
        print(f"result written at epoch {trainer.version}, sync {opt.sync_stats}", flush=True)

        hold_until = time.monotonic() + args.hold_seconds
        while not stop.is_set() and time.monotonic() < hold_until:
            if args.hold_file and Path(args.hold_file).exists():
                break
            stop.wait(0.1)
        return 0
    finally:
        t0 = time.monotonic()
        clean = shutdown_optimizer(opt, timeout=10)
        t1 = time.monotonic()
        stop_dht(dht, timeout=10)
        print(
            f"optimizer shutdown {t1 - t0:.1f}s (clean={clean}), DHT {time.monotonic() - t1:.1f}s", flush=True
        )
        identity.cleanup()


if __name__ == "__main__":
    sys.exit(main())
