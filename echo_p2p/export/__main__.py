"""``python -m echo_p2p.export``: write a trained policy as a Hugging Face model directory.

From a trainer checkpoint (``--checkpoint DIR``) or from a running swarm (``--join ADDRESS``, or
``--run-id`` + ``--initial-peers`` + ``--trusted-trainers FILE``); ``--out DIR`` is the model directory.
Parses and validates everything before importing torch or hivemind (``--help`` is instant); exit codes:
0 written, 2 bad flags, 1 the export failed (one line on stderr says why). The work is ``export.checkpoint``
and ``export.live``.
"""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from echo_p2p import __version__
from echo_p2p.cli import EXIT_CONFIG, EXIT_START, add_network_flags, fail
from echo_p2p.export.config import ExportDtype


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m echo_p2p.export",
        description="Write a trained policy as a Hugging Face model directory (config, tokenizer, "
        "model.safetensors, generation config) that transformers and vLLM load.",
    )
    parser.add_argument("--version", action="version", version=f"echo_p2p {__version__}")
    parser.add_argument("--out", required=True, metavar="DIR", help="the model directory to write")
    parser.add_argument(
        "--dtype",
        choices=get_args(ExportDtype),
        default=None,
        help="dtype of the exported weights (default: the dtype the run's inference peers hold, bfloat16 "
        "unless the trainers published another; bfloat16 for a checkpoint that does not say)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it is not empty")
    source = parser.add_argument_group("source: a checkpoint")
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="a trainer's --checkpoint-dir (its newest complete checkpoint) or one ckpt-... directory",
    )
    live = parser.add_argument_group("source: a running swarm")
    live.add_argument(
        "--join",
        metavar="RUN:OWNER@MADDRS",
        default=None,
        help="the run's join address: the newest version of the trainers its owner's run record lists",
    )
    live.add_argument("--run-id", default=None, help="the run (with --initial-peers and --trusted-trainers)")
    live.add_argument(
        "--trusted-trainers",
        metavar="FILE",
        default=None,
        help="for runs without an owner: the trainers whose versions are accepted",
    )
    live.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to join, find and fetch the newest version before failing (default 300)",
    )
    live.add_argument(
        "--min-version", type=int, default=None, metavar="N", help="wait for a version at least this new"
    )
    add_network_flags(parser, host_default_help="default /ip4/0.0.0.0/tcp/0")
    model = parser.add_argument_group(
        "model (default: the checkpoint's own config and tokenizer, or the preset the run record names)"
    )
    model.add_argument("--model", choices=["tiny", "smollm2"], default=None, help="built-in model preset")
    model.add_argument("--model-path", metavar="DIR", default=None, help="a local model directory")
    model.add_argument("--gguf-file", metavar="FILE", default=None, help="a GGUF file")
    return parser


def _configs(args: argparse.Namespace):
    """(ExportConfig, LiveExportConfig or None, Target or None); ``ValueError`` with a message for the user."""
    from echo_p2p.export.config import ExportConfig, LiveExportConfig
    from echo_p2p.ml.models import ModelSpec

    live_flags = args.join or args.run_id or args.trusted_trainers or args.initial_peers
    if bool(args.checkpoint) == bool(live_flags):
        raise ValueError(
            "give one source: --checkpoint DIR, or a run (--join, or --run-id + --initial-peers)"
        )
    if args.checkpoint and (args.timeout is not None or args.min_version is not None):
        raise ValueError("--timeout and --min-version apply to an export from a running swarm")
    sources = {"preset": args.model, "path": args.model_path, "gguf_file": args.gguf_file}
    sources = {k: v for k, v in sources.items() if v is not None}
    spec = ModelSpec(**sources) if sources else None
    config = ExportConfig(out=args.out, dtype=args.dtype, model=spec, overwrite=args.overwrite)
    if args.checkpoint:
        return config, None, None
    from echo_p2p.monitor.target import resolve_target

    target = resolve_target(args)
    if not target.trust.configured:
        raise ValueError(
            "the run's trainers are unknown: pass --join (the run owner's address) or --trusted-trainers FILE"
        )
    live = LiveExportConfig(
        **{k: v for k, v in (("timeout", args.timeout), ("min_version", args.min_version)) if v is not None}
    )
    return config, live, target


def quiet_progress_bars() -> None:
    """No transformers progress bars ("Writing model shards", "Loading weights"): one line says what was
    written."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> None:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    try:
        config, live, target = _configs(args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'model'}: {e['msg']}" for e in exc.errors())
        fail(problems, EXIT_CONFIG)
    except ValueError as exc:  # ConfigError and bad join addresses or files included
        fail(str(exc), EXIT_CONFIG)

    from echo_p2p.export.config import ExportError
    from echo_p2p.logs import setup_logging

    setup_logging("WARNING")
    import logging

    logging.getLogger("echo_p2p.export").setLevel(logging.INFO)
    quiet_progress_bars()
    try:
        if target is None:
            from echo_p2p.export.checkpoint import export_checkpoint

            result = export_checkpoint(args.checkpoint, config)
        else:
            from echo_p2p.export.live import export_live

            result = export_live(target, config, live)
    except ExportError as exc:
        fail(str(exc), EXIT_START)
    print(f"exported policy version {result.version} ({result.dtype}) from {result.source} to {result.path}")
    sys.exit(0)


if __name__ == "__main__":
    main()
