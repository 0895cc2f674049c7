"""Writing a policy as a Hugging Face model directory: the one place an export touches the disk.

Owned here: ``prepare_out`` (refuse an existing, non-empty directory unless told to overwrite, before any
work) and ``write_model_dir``: cast the model to the export dtype, refuse values that are not finite there
(fp16 overflows beyond +-65504), fill in the generation config (EOS and padding from the tokenizer; the
run's temperature, top-p and top-k when known, as the policy was trained to sample), then write
``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer files and
``EXPORT_INFO_FILE`` into a temporary sibling directory and rename it into place, so a reader never sees
half an export. The layout is what ``save_pretrained`` writes: ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` load it offline and vLLM serves it.
Callers: ``export.checkpoint`` and ``export.live``. Pure ML: no hivemind, no network.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo_p2p.export.config import EXPORT_INFO_FILE, ExportDtype, ExportError
from echo_p2p.paths import expand_path

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def prepare_out(out: str | os.PathLike, overwrite: bool) -> Path:
    """The export's target directory; ``ExportError`` when it exists and holds something (and
    ``overwrite`` is off) or is not a directory."""
    path = Path(expand_path(str(out)))
    if path.exists() and not path.is_dir():
        raise ExportError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ExportError(f"{path} exists and is not empty (pass --overwrite to replace it)")
    return path


def write_model_dir(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: str | os.PathLike,
    dtype: ExportDtype,
    info: Mapping[str, Any],
    sampling: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (cast to ``dtype`` in place) and ``tokenizer`` as a model directory at ``out``;
    ``info`` goes into ``EXPORT_INFO_FILE`` (with the dtype and the time). Returns the directory."""
    import torch

    from echo_p2p.ml.models import save_policy

    path = prepare_out(out, overwrite)
    torch_dtype = getattr(torch, dtype)
    model.to(dtype=torch_dtype)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ExportError(
                    f"{name} holds values that are not finite in {dtype}"
                    + (" (beyond float16's range: export bfloat16 or float32)" if dtype == "float16" else "")
                )
    _fill_generation_config(model, tokenizer, sampling)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        save_policy(model, tokenizer, tmp)
        record = {**info, "dtype": dtype, "exported_at": time.time()}
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        if path.exists():  # checked by prepare_out: empty, or overwrite
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _fill_generation_config(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sampling: Mapping[str, Any] | None
) -> None:
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.pad_token_id is None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    if sampling:  # how the run sampled: what serving engines take as the model's default sampling
        config.do_sample = True
        config.temperature = float(sampling.get("temperature") or 1.0)
        config.top_p = float(sampling.get("top_p") or 1.0)
        config.top_k = int(sampling.get("top_k") or 0)  # 0: off, in transformers as in echo_p2p
