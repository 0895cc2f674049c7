"""What a trainer checkpoint carries so that it exports without ``--model``: the model's own files, and a
description of the policy in its ``meta.json``.

Owned here: ``policy_files`` (the files of a Hugging Face model directory other than the weights —
``config.json``, ``generation_config.json``, the tokenizer files — as bytes, which the trainer attaches to
every checkpoint), ``policy_meta`` (the ``policy`` entry of the checkpoint's ``extra``: the model spec, the
precision inference peers hold, the run's sampling) and their readers, ``skeleton_from_files`` (the model,
fp32 on CPU, and the tokenizer those files describe), ``skeleton_from_spec`` (the same from a ``ModelSpec``),
``spec_name`` and ``PolicyMeta``. Both sides live here so that what
the trainer writes and what the export reads cannot drift apart.
Callers: the trainer peer (``roles.trainer``), ``export.checkpoint``, ``export.live``, tests. Pure ML: no hivemind, no
network; torch and transformers are imported inside the functions. Never executes code from the files
(no ``trust_remote_code``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: The key of the checkpoint's ``extra`` (``meta.json``) that describes the policy.
META_KEY = "policy"

#: Files a model directory may hold besides its weights: what ``policy_files`` keeps.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def policy_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for ``model``'s config, its generation config and ``tokenizer``,
    by file name (no weights): enough, with a state dict, to rebuild the model with ``from_pretrained``."""
    with tempfile.TemporaryDirectory(prefix="echo-policy-files-") as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return {
            p.name: p.read_bytes()
            for p in sorted(Path(tmp).iterdir())
            if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
        }


def policy_meta(run: Any, serving_precision: str | None) -> dict[str, Any]:
    """The ``{META_KEY: ...}`` entry of a checkpoint's ``extra``: ``run`` is the peer's ``RunSettings`` (its
    model spec and sampling), ``serving_precision`` what inference peers hold ('bf16', 'fp16'; None: fp32)."""
    return {
        META_KEY: {
            "model": run.model.model_dump(mode="json"),
            "serving_precision": serving_precision,
            "sampling": {"temperature": run.temperature, "top_p": run.top_p, "top_k": run.top_k},
        }
    }


@dataclass(frozen=True)
class PolicyMeta:
    """What a checkpoint's ``extra`` says about its policy (every field None when it says nothing)."""

    model: dict[str, Any] | None = None
    serving_precision: str | None = None
    known_precision: bool = False  # whether the checkpoint says it (None means fp32 then)
    sampling: dict[str, Any] | None = None

    @classmethod
    def of(cls, extra: Mapping[str, Any]) -> PolicyMeta:
        entry = extra.get(META_KEY)
        if not isinstance(entry, Mapping):
            return cls()
        model, sampling = entry.get("model"), entry.get("sampling")
        precision = entry.get("serving_precision")
        return cls(
            model=dict(model) if isinstance(model, Mapping) else None,
            serving_precision=precision if precision in ("bf16", "fp16") else None,
            known_precision="serving_precision" in entry and precision in ("bf16", "fp16", None),
            sampling=dict(sampling) if isinstance(sampling, Mapping) else None,
        )


def skeleton_from_files(files: Mapping[str, bytes]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (fp32, CPU, freshly initialised: load the weights into it) and the tokenizer that
    ``policy_files`` output describes, through ``AutoConfig`` / ``AutoTokenizer.from_pretrained`` offline."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory(prefix="echo-policy-files-") as tmp:
        for name, data in files.items():
            if Path(name).name != name:
                raise ValueError(f"not a plain file name: {name!r}")
            (Path(tmp) / name).write_bytes(data)
        config = AutoConfig.from_pretrained(tmp, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if "generation_config.json" in files:
            model.generation_config = GenerationConfig.from_pretrained(tmp, local_files_only=True)
    return model.eval(), tokenizer


def skeleton_from_spec(spec: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (fp32, CPU, unquantised) and the tokenizer ``spec`` (a ``ModelSpec``) names, through
    ``load_policy``; ``ModelNotFoundError`` when it is not on this machine."""
    from echo_p2p.ml.models import load_policy

    return load_policy(spec.model_copy(update={"quantize": None, "dtype": "float32", "device": "cpu"}))


def spec_name(spec: Any) -> str:
    """A ``ModelSpec``'s model, for messages: its preset, GGUF file or path."""
    return spec.preset or spec.gguf_file or spec.path or "?"
