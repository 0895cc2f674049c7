"""Export from a trainer checkpoint: find it, read its verified weights, rebuild the model, write it out.

Owned here: ``find_checkpoint`` (a checkpoint directory, or a trainer's ``--checkpoint-dir``: its newest
complete checkpoint), ``newest_checkpoint`` (among several trainers' directories, as a local run has) and
``export_checkpoint``. The model the weights belong to is, in this order: ``ExportConfig.model`` (the
command line), the config and tokenizer files the checkpoint carries (``policy_files``), the model spec its
``meta.json`` records; a checkpoint with none of them (written before checkpoints described their model) is
refused with the flags to pass. The weights are the trainer's fp32 master weights, read once and checked
against their sha256 (the optimizer state is never read); they must fit the model exactly (every name,
every shape). The default dtype is the one the run's inference peers held (``meta.json``), else bfloat16.
Callers: ``export.__main__``, ``echo_p2p.local`` (through the CLI), tests. No hivemind, no network.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from echo_p2p.export.config import (
    FALLBACK_DTYPE,
    ExportConfig,
    ExportError,
    ExportResult,
    serving_dtype_name,
)
from echo_p2p.export.model_dir import prepare_out, write_model_dir
from echo_p2p.export.policy_files import PolicyMeta, skeleton_from_files, skeleton_from_spec, spec_name
from echo_p2p.paths import expand_path
from echo_p2p.train.checkpoint import (
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    Checkpoint,
    CheckpointError,
    CheckpointManager,
)

logger = logging.getLogger(__name__)

_OWN_FILES = (MODEL_FILE, OPTIMIZER_FILE, META_FILE)


def find_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``path`` (a ``ckpt-...`` directory), or the newest complete one in ``path`` (a
    trainer's checkpoint directory); ``ExportError`` when there is none."""
    path = Path(expand_path(str(path)))
    if not path.is_dir():
        raise ExportError(f"no checkpoint at {path}: not a directory")
    if (path / META_FILE).is_file():
        found = [c for c in CheckpointManager(path.parent).list() if c.path == path]
        if not found:
            raise ExportError(f"{path} is not a complete checkpoint (torn, or its meta.json does not match)")
        return found[0]
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise ExportError(f"no complete checkpoint in {path}")
    return latest


def newest_checkpoint(directories: Iterable[str | os.PathLike]) -> Checkpoint | None:
    """The complete checkpoint of the highest version (then the latest saved) in any of ``directories``."""
    found = [c for d in directories if (c := CheckpointManager(d).latest()) is not None]
    return max(found, key=lambda c: (c.version, c.created), default=None)


def export_checkpoint(path: str | os.PathLike, config: ExportConfig) -> ExportResult:
    """Write the policy of the checkpoint at ``path`` (see ``find_checkpoint``) as a model directory."""
    prepare_out(config.out, config.overwrite)  # fail before any work
    ckpt = find_checkpoint(path)
    meta = PolicyMeta.of(ckpt.extra)
    model, tokenizer, described_by = _skeleton(ckpt, meta, config)
    state = _weights(ckpt)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ExportError(
            f"the weights of {ckpt.path.name} do not fit the model of {described_by}: {_short(exc)}"
        ) from None
    dtype = config.dtype or (
        serving_dtype_name(meta.serving_precision) if meta.known_precision else FALLBACK_DTYPE
    )
    info: dict[str, Any] = {
        "source": "checkpoint",
        "checkpoint": str(ckpt.path.resolve()),
        "version": ckpt.version,
        "model": described_by,
    }
    out = write_model_dir(model, tokenizer, config.out, dtype, info, meta.sampling, config.overwrite)
    logger.info("exported version %d of %s to %s (%s)", ckpt.version, ckpt.path, out, dtype)
    return ExportResult(str(out), ckpt.version, dtype, f"checkpoint {ckpt.path}")


def _skeleton(ckpt: Checkpoint, meta: PolicyMeta, config: ExportConfig) -> tuple[Any, Any, str]:
    """(model fp32 on CPU, tokenizer, what described them)."""
    from echo_p2p.ml.models import ModelNotFoundError, ModelSpec

    spec = config.model
    described_by = "the command line"
    if spec is None and "config.json" in ckpt.files:
        try:
            files = {name: ckpt.read_file(name) for name in ckpt.files if name not in _OWN_FILES}
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None
        try:
            model, tokenizer = skeleton_from_files(files)
        except Exception as exc:
            raise ExportError(
                f"the model files of {ckpt.path.name} cannot be loaded: {_short(exc)}"
            ) from None
        return model, tokenizer, "the checkpoint's config and tokenizer files"
    if spec is None and meta.model is not None:
        try:
            spec = ModelSpec.model_validate(meta.model)
        except ValueError as exc:
            raise ExportError(
                f"the model spec in {ckpt.path.name}/meta.json is invalid: {_short(exc)}"
            ) from None
        described_by = "the checkpoint's model spec"
    if spec is None:
        raise ExportError(
            f"{ckpt.path.name} does not describe its model (written before checkpoints carried their config "
            "and tokenizer): pass the run's model, --model tiny|smollm2, --model-path DIR or --gguf-file FILE"
        )
    try:
        model, tokenizer = skeleton_from_spec(spec)
    except ModelNotFoundError as exc:
        raise ExportError(str(exc)) from None
    return model, tokenizer, f"{described_by} ({spec_name(spec)})"


def _weights(ckpt: Checkpoint) -> dict[str, Any]:
    from safetensors.torch import load

    try:
        return load(ckpt.read_file(MODEL_FILE))
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    except Exception as exc:
        raise ExportError(f"{ckpt.path.name}/{MODEL_FILE} is unreadable: {_short(exc)}") from None


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
