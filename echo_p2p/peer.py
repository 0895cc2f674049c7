"""``python -m echo_p2p.peer --role inference|trainer --initial-peers MADDR... --run-id NAME``

Parses flags, merges them over the YAML config (``--config``) and ``ECHO_*`` variables, validates
everything (exit 2 on a bad field) and only then imports the heavy stack and starts the role's peer.
"""

from __future__ import annotations

import argparse
import os

from echo_p2p import __version__
from echo_p2p.cli import (
    EXIT_CONFIG,
    EXIT_START,
    add_network_flags,
    add_task_option_flag,
    fail,
    network_flags,
    run_peer,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.peer",
        description="Join an echo_p2p run as an inference or trainer peer. "
        "Precedence: flags > ECHO_* environment variables > --config YAML > defaults.",
    )
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    parser.add_argument(
        "--role", choices=["inference", "trainer"], default=None, help="the peer's role (env ECHO_ROLE)"
    )
    parser.add_argument("--run-id", default=None, help="name of the run to join (env ECHO_RUN_ID)")
    parser.add_argument(
        "--join",
        metavar="RUN:OWNER@MADDRS",
        default=None,
        help="one address to join a run: its id, the owner key's peer id and bootstrap multiaddrs "
        "(comma-separated); trust follows the owner's signed run record (docs/trust.md)",
    )
    parser.add_argument(
        "--run-record",
        metavar="FILE",
        default=None,
        help="the owner's signed run record (python -m echo_p2p.owner sign): kept on the DHT by this peer",
    )
    parser.add_argument("--config", metavar="FILE", default=None, help="YAML config file (see peers/*.yaml)")
    parser.add_argument(
        "--mode", choices=["sync", "async"], default=None, help="sync: sequential pull; async: push-pull"
    )
    parser.add_argument(
        "--metrics-dir", metavar="DIR", default=None, help="append metrics as JSON lines here"
    )
    parser.add_argument(
        "--heartbeat-period", type=float, metavar="S", default=None, help="seconds between announcements"
    )
    parser.add_argument(
        "--record-ttl", type=float, metavar="S", default=None, help="lifetime of an announcement"
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default=None)
    parser.add_argument(
        "--restart-on-stall",
        action="store_true",
        default=None,
        help="when the watchdog finds a stall, exit 75 (after a thread dump) so that a supervisor restarts "
        "the peer (systemd Restart=on-failure; docs/reliability.md); default: keep running, announce it",
    )
    parser.add_argument(
        "--stall-deadline",
        type=float,
        metavar="S",
        default=None,
        help="every watchdog deadline: record stored, heartbeat, training steps, sampling, versions "
        "applied (default 120 s for the DHT, 600 s for the work)",
    )
    run = parser.add_argument_group("run (every peer of a run must agree)")
    run.add_argument("--model", choices=["tiny", "smollm2"], default=None, help="built-in model preset")
    run.add_argument("--model-path", metavar="DIR", default=None, help="a local model directory instead")
    run.add_argument("--gguf-file", metavar="FILE", default=None, help="a GGUF file instead")
    run.add_argument("--task", default=None, help="task: count, letter, arithmetic, sokoban, plugin")
    add_task_option_flag(run)
    run.add_argument("--group-size", type=int, default=None, help="completions per prompt (G)")
    run.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    run.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1 = off)")
    run.add_argument("--top-k", type=int, default=None, help="top-k sampling (0 = off)")
    run.add_argument(
        "--sampler-precisions",
        default=None,
        help="comma-separated weight precisions of samplers whose rollouts count (float32, bfloat16, "
        "float16, 8bit, 4bit; default any)",
    )
    run.add_argument("--max-new-tokens", type=int, default=None, help="completion length cap")
    run.add_argument(
        "--no-seeded-sampling",
        action="store_true",
        default=None,
        help="a run whose rollouts need not be drawn from a seed trainers replay (run.seeded_sampling false): "
        "what a vLLM sampler needs; edits are then caught by statistics only (docs/security.md)",
    )
    inf = parser.add_argument_group("inference")
    inf.add_argument(
        "--trusted-trainers",
        metavar="FILE",
        default=None,
        help="keys of the run's trainers, for runs without an owner: whose weights an inference peer accepts, "
        "among whom trainers elect the publisher (env ECHO_TRUSTED_TRAINERS; docs/trust.md)",
    )
    inf.add_argument(
        "--prompts-per-batch", type=int, default=None, help="async: prompts sampled together (default 16)"
    )
    inf.add_argument("--engine", choices=["transformers", "vllm"], default=None, help="sampling engine")
    inf.add_argument("--quantize", choices=["8bit", "4bit"], default=None, help="load the policy in 8/4-bit")
    inf.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda:0")
    tr = parser.add_argument_group("trainer")
    tr.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="write checkpoints here")
    tr.add_argument("--resume", action="store_true", default=None, help="continue from the newest checkpoint")
    tr.add_argument("--max-steps", type=int, default=None, help="stop after this many training steps")
    tr.add_argument("--lr", type=float, default=None, help="learning rate of the trainers' AdamW")
    tr.add_argument(
        "--kl-beta",
        type=float,
        default=None,
        help="KL penalty to the starting policy (TRL's beta; default 0: no reference model)",
    )
    tr.add_argument(
        "--prompts-per-step", type=int, default=None, help="rollout groups per GRPO step (default 16)"
    )
    tr.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="rollout groups the trainers together accumulate per policy version (default 16)",
    )
    tr.add_argument(
        "--publish-interval",
        type=float,
        default=None,
        metavar="S",
        help="async: fewest seconds between two published versions (default 0: every version)",
    )
    tr.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help="async: drop rollouts more than this many versions old",
    )
    tr.add_argument(
        "--eval-every",
        type=float,
        default=None,
        metavar="S",
        help="the publisher scores the held-out prompts every S seconds, within 5%% of the time (default 5)",
    )
    tr.add_argument(
        "--no-eval", action="store_true", default=None, help="no held-out evaluation on the trainer"
    )
    tr.add_argument(
        "--report-to",
        nargs="+",
        choices=["tensorboard", "wandb"],
        default=None,
        help="also write the training figures (reward, kl, clip_ratio, ...) as TensorBoard event files and/or "
        "an offline wandb run (optional packages: pip install 'echo_p2p[tensorboard]')",
    )
    tr.add_argument(
        "--report-dir",
        metavar="DIR",
        default=None,
        help="folder of the --report-to files (default <metrics-dir>/tensorboard)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=None, help="seed of prompt choice and sampling")
    add_network_flags(parser, host_default_help="default /ip4/0.0.0.0/tcp/0: all interfaces, a free port")
    return parser


def parse_config(argv: list[str] | None = None, environ=None):
    """Flags + env + YAML -> ``PeerConfig``; raises ``ConfigError``."""
    from echo_p2p.config import PeerConfig, build_config

    args = build_parser().parse_args(argv)
    flags = {
        "role": args.role,
        "run_id": args.run_id,
        "mode": args.mode,
        "metrics_dir": args.metrics_dir,
        "heartbeat_period": args.heartbeat_period,
        "record_ttl": args.record_ttl,
        "log_level": args.log_level,
        "watchdog.restart_on_stall": args.restart_on_stall,
        "watchdog.dht_deadline": args.stall_deadline,
        "watchdog.work_deadline": args.stall_deadline,
        "run.task": args.task,
        "run.group_size": args.group_size,
        "run.temperature": args.temperature,
        "run.top_p": args.top_p,
        "run.top_k": args.top_k,
        "run.sampler_precisions": args.sampler_precisions.split(",") if args.sampler_precisions else None,
        "run.max_new_tokens": args.max_new_tokens,
        "run.seeded_sampling": False if args.no_seeded_sampling else None,
        "trusted_trainers": args.trusted_trainers,
        "threads": args.threads,
        "seed": args.seed,
        "run_record": args.run_record,
        "inference.engine": args.engine,
        "inference.prompts_per_batch": args.prompts_per_batch,
        "trainer.checkpoint_dir": args.checkpoint_dir,
        "trainer.resume": args.resume,
        "trainer.max_steps": args.max_steps,
        "trainer.optimizer.lr": args.lr,
        "trainer.grpo.kl_beta": args.kl_beta,
        "trainer.max_staleness": args.max_staleness,
        "trainer.publish_interval": args.publish_interval,
        "trainer.prompts_per_step": args.prompts_per_step,
        "trainer.collab.target_batch_size": args.target_batch_size,
        "trainer.report.report_to": args.report_to,
        "trainer.evaluation.every_seconds": args.eval_every,
        "trainer.evaluation.enabled": False if args.no_eval else None,
        "trainer.report.dir": args.report_dir,
        "run.task_options": dict(args.task_option) or None,
        **network_flags(args),
    }
    model: dict[str, str] = {}
    for key, value in (("preset", args.model), ("path", args.model_path), ("gguf_file", args.gguf_file)):
        if value is not None:
            model[key] = value
    if model:  # a model source on the command line replaces the config file's model
        flags["run.model"] = model
    for key, value in (("quantize", args.quantize), ("device", args.device)):
        if value is not None:
            flags[f"run.model.{key}"] = value
    if args.join is not None:
        from echo_p2p.config import ConfigError
        from echo_p2p.net.run_record import JoinAddress

        try:
            join = JoinAddress.parse(args.join)
        except ValueError as exc:
            raise ConfigError(f"--join: {exc}") from None
        if args.run_id is not None and args.run_id != join.run_id:
            raise ConfigError(f"--run-id {args.run_id} differs from the run of --join ({join.run_id})")
        flags["run_id"] = join.run_id
        flags["run_owner"] = join.owner
        if join.min_serial:
            flags["run_record_serial"] = join.min_serial
        if not flags.get("network.initial_peers"):
            flags["network.initial_peers"] = list(join.initial_peers)
    return build_config(
        PeerConfig, yaml_path=args.config, environ=os.environ if environ is None else environ, flags=flags
    )


def make_peer(config):
    if config.role == "inference":
        from echo_p2p.roles.inference import InferencePeer

        return InferencePeer(config)
    from echo_p2p.roles.trainer.peer import TrainerPeer

    return TrainerPeer(config)


def main(argv: list[str] | None = None) -> None:
    from echo_p2p.config import ConfigError

    try:
        config = parse_config(argv)
    except ConfigError as exc:
        fail(str(exc), EXIT_CONFIG)
    from echo_p2p.guard.trust import TrustedTrainers, TrustFileError

    if config.trusted_trainers:
        try:
            TrustedTrainers.from_file(config.trusted_trainers)
        except (TrustFileError, OSError) as exc:
            fail(f"--trusted-trainers: {exc}", EXIT_CONFIG)
    if config.run_record:
        from echo_p2p.net.run_record import read_file

        try:
            record, _, _ = read_file(config.run_record)
        except ValueError as exc:
            fail(f"--run-record: {exc}", EXIT_CONFIG)
        if record.run_id != config.run_id or config.run_owner not in (None, record.owner_peer_id()):
            fail(f"--run-record: {config.run_record} is not a record of this run and owner", EXIT_CONFIG)
    from echo_p2p.ml.machine import machine_problems

    engine = config.inference.engine if config.role == "inference" else "transformers"
    problems = machine_problems(config.run.model, engine)
    if problems:  # before joining: the run never sees a peer that cannot sample
        fail(problems[0], EXIT_CONFIG)
    from echo_p2p.logs import setup_logging

    setup_logging(config.log_level)
    from echo_p2p.net.lean_hivemind import use_lean_hivemind

    use_lean_hivemind()  # hivemind's averagers and optimizer: only once a trainer builds its optimizer
    from echo_p2p.net.identity import IdentityError

    try:
        peer = make_peer(config)
    except IdentityError as exc:
        fail(str(exc), EXIT_START)
    if config.role == "inference":
        from echo_p2p.progress import WeightsProgress

        peer.on_weights_progress = WeightsProgress()
    run_peer(peer, f"{config.role} peer")


if __name__ == "__main__":
    main()
