"""vLLM sampling engine (CUDA only, optional): the ``Engine`` interface on ``vllm.LLM``.

Owned here: ``VllmEngine`` / ``VllmEngineConfig`` and the worker extension through which new policy
versions are loaded in place into vLLM's workers.
Called by the inference peer when ``engine = "vllm"``. vLLM is an optional extra (``pip install
echo_p2p[vllm]``, in its own environment on a GPU box): it is imported lazily inside ``VllmEngine``, so this
module imports without it. Must not import hivemind.

Targets vLLM >= 0.10.2 (V1 engine): ``LLM(logprobs_mode="processed_logprobs", worker_extension_cls=...)``,
``LLM.collective_rpc`` and ``LLM.reset_prefix_cache``. Checked against the vLLM sources, not run here
(no GPU on the development machines): its test is marked ``gpu`` and skips without CUDA + vllm.

Log-probs: ``logprobs_mode="processed_logprobs"`` makes vLLM report the log-prob of each sampled token after
temperature and top-k/top-p, the same convention as ``echo_p2p.ml.engine`` (see its docstring).
Each of the ``n`` samples of a prompt is its own request with ``n=1`` and seed ``seed + k`` so that seeded
samples differ (vLLM seeds every child of an ``n > 1`` request alike).
Weight updates: the full-precision tensors are written to one safetensors file (``/dev/shm`` when present)
and every worker loads it with ``model.load_weights`` (vLLM's own loader: it fuses qkv / gate-up itself),
then the prefix cache is reset so no KV block computed by the old version is reused.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.ml.engine import Engine, EngineStats, Sample, SamplingParams, _Timer

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from echo_p2p.ml.models import ModelSpec


class VllmEngineConfig(BaseModel):
    """Settings passed to ``vllm.LLM``."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="Share of GPU memory vLLM takes"
    )
    max_model_len: int | None = Field(default=None, description="Context length cap (None: the model's)")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one model is split over")
    enforce_eager: bool = Field(
        default=False, description="Disable CUDA graphs (faster start, slower decode)"
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Any other vllm.LLM keyword argument")


class EchoVllmWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); methods are called by ``collective_rpc``.
    Kept free of module-level vllm imports so workers import it cheaply."""

    def echo_load_weights_file(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        self.model_runner.model.load_weights(weights=list(weights.items()))  # type: ignore[attr-defined]
        return len(weights)


class VllmEngine(Engine):
    """``Engine`` on vLLM. Build it from a ``ModelSpec``: a local directory is given to vLLM as is; presets
    and GGUF files are first loaded with transformers and saved (full precision) to a temporary directory.
    bitsandbytes quantisation (``spec.quantize``) is not supported here: use ``dtype="bfloat16"``."""

    def __init__(self, spec: ModelSpec, config: VllmEngineConfig | None = None) -> None:
        try:
            import vllm
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "VllmEngine needs vLLM (CUDA only): pip install 'echo_p2p[vllm]' in a GPU environment"
            ) from exc
        if spec.quantize is not None:
            raise ValueError("VllmEngine does not take bitsandbytes quantisation; use dtype='bfloat16'")
        self.config = config or VllmEngineConfig()
        self.stats = EngineStats()
        self._lock = threading.Lock()
        self._tmp: tempfile.TemporaryDirectory | None = None
        model_dir = self._model_dir(spec)
        self.llm = vllm.LLM(
            model=model_dir,
            tokenizer=model_dir,
            dtype=spec.dtype,
            seed=spec.seed,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            max_model_len=self.config.max_model_len,
            tensor_parallel_size=self.config.tensor_parallel_size,
            enforce_eager=self.config.enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.EchoVllmWorkerExtension",
            **self.config.extra,
        )
        self._vllm = vllm

    def _model_dir(self, spec: ModelSpec) -> str:
        if (
            spec.preset is None
            and spec.gguf_file is None
            and spec.path is not None
            and Path(spec.path).is_dir()
        ):
            return spec.path
        from echo_p2p.ml.models import load_policy, save_policy

        model, tokenizer = load_policy(spec.model_copy(update={"device": "cpu", "dtype": "float32"}))
        self._tmp = tempfile.TemporaryDirectory(prefix="echo_vllm_model_")
        save_policy(model, tokenizer, self._tmp.name)
        return self._tmp.name

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
        from safetensors.torch import save_file

        shm = Path("/dev/shm")
        directory = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        with self._lock, tempfile.TemporaryDirectory(prefix="echo_vllm_w_", dir=directory) as tmp:
            path = os.path.join(tmp, "weights.safetensors")
            save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, path)
            self.llm.collective_rpc("echo_load_weights_file", args=(path,))
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Free the temporary model directory (vLLM itself is released with the object)."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
