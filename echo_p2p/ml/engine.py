"""Sampling engines: the ``Engine`` interface and ``TransformersEngine`` (CPU and GPU).

Owned here: ``SamplingParams``, ``Sample``, the ``Engine`` ABC, the sampling-distribution maths
(``process_logits``: temperature, top-k, top-p) shared by every engine and by ``completion_logprobs`` (a
direct forward pass giving the same log-probs, for tests and for trainers that want them), and a batched
KV-cache sampling loop on a transformers causal LM whose draws are replayable: completion ``k`` of a prompt
is drawn from its group's seed (``ml.seeded``, ``Sample.seed``), so a trainer can check it is a sample.
Called by the inference peer (sample rollouts, load each new policy version) and by tests and benchmarks.
Must not import hivemind or know about tasks/rewards: it maps token ids to token ids + log-probs.

Log-prob convention: each returned log-prob is ``log p(token)`` under the distribution the token was drawn
from: ``log_softmax(filter(logits / temperature))`` in fp32, where ``filter`` keeps the ``top_k`` largest
logits and then the smallest set of tokens whose probability reaches ``top_p`` (others get -inf). With the
RL defaults (``top_k=0``, ``top_p=1``) it is exactly the tempered policy a trainer recomputes. With
``temperature == 0`` decoding is greedy and the log-probs are those of the untempered, unfiltered model
(``log_softmax(logits)``), for evaluation; greedy samples are not meant for policy-gradient training.
"""

from __future__ import annotations

import inspect
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.ml.seeded import derive_seed, draw, new_seed, uniforms

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class SamplingParams(BaseModel):
    """How to sample completions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="Softmax temperature; 0 = greedy decoding")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 = off")
    top_k: int = Field(default=0, ge=0, description="Keep only the k most likely tokens; 0 = off")
    max_new_tokens: int = Field(default=32, ge=1, description="Completion length cap (EOS included)")
    seed: int | None = Field(
        default=None,
        description="Seed of the draws (each prompt's group seed is derived from it, ``ml.seeded``); None = a "
        "fresh random seed per prompt",
    )


@dataclass
class Sample:
    """One completion: its token ids (EOS included when sampled, no padding), the log-prob of each token
    under the sampling distribution (same length), and whether it ended with EOS (False: hit the cap)."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    #: the seed of its group's draws (``ml.seeded``; the sample is draw ``j`` of prompt ``i``'s seed for
    #: ``result[i][j]``), "" when the engine does not draw from a seed
    seed: str = ""


@dataclass
class EngineStats:
    """Throughput bookkeeping: tokens sampled (EOS included, padding excluded) and seconds spent sampling."""

    tokens: int = 0
    seconds: float = 0.0
    calls: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Timer:
    stats: EngineStats
    start: float = field(default_factory=time.perf_counter)

    def done(self, tokens: int) -> None:
        self.stats.tokens += tokens
        self.stats.seconds += time.perf_counter() - self.start
        self.stats.calls += 1


class Engine(ABC):
    """Samples completions from the current policy; swaps in new policy versions in place.

    Implementations are thread-safe in one respect: ``load_weights`` waits for a running ``sample`` to end,
    so a batch is never sampled by a mix of two versions.
    """

    stats: EngineStats

    @abstractmethod
    def sample(self, prompt_token_ids: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        """``n`` completions of each prompt (unpadded token ids): result[i][j] is sample j of prompt i."""

    @abstractmethod
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a new policy version (full-precision tensors named as in the model's state_dict) in place."""

    def update_weights(
        self, weights: dict[str, torch.Tensor], changed: Mapping[str, torch.Tensor | None]
    ) -> None:
        """Load a version that differs from the one held only where ``changed`` says: per tensor name, the
        flat positions that changed (None: the whole tensor); tensors not named are unchanged. ``weights``
        holds every tensor of the new version. This default loads the changed tensors whole."""
        self.load_weights({name: weights[name] for name in changed})

    @property
    def tokens_per_second(self) -> float:
        return self.stats.tokens_per_second

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release what the engine holds beyond Python memory (temporary files, GPU workers)."""


# ----------------------------------------------------------------------------------------------- distribution


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs (fp32, same shape) of the sampling distribution for raw ``logits`` [..., vocab]:
    temperature, then top-k, then top-p; filtered tokens get -inf.
    Temperature 0: ``log_softmax(logits)`` (see the module docstring)."""
    import torch

    x = logits.float()
    if params.temperature == 0:
        return torch.log_softmax(x, dim=-1)
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the top token always stays (mass_before == 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def completion_logprobs(
    model: PreTrainedModel,
    prompt_token_ids: list[list[int]],
    completion_token_ids: list[list[int]],
    params: SamplingParams,
    pad_token_id: int = 0,
) -> list[list[float]]:
    """Log-prob of every completion token under ``process_logits(params)``, by one plain forward pass over
    prompt + completion (no cache, right padding). The reference the engines are tested against."""
    import torch

    device = next(model.parameters()).device
    seqs = [list(p) + list(c) for p, c in zip(prompt_token_ids, completion_token_ids, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits
        lp = process_logits(logits, params)
    out: list[list[float]] = []
    for i, (p, c) in enumerate(zip(prompt_token_ids, completion_token_ids, strict=True)):
        if not c:
            out.append([])
            continue
        pos = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
        tok = torch.tensor(c, dtype=torch.long, device=device)
        out.append(lp[i, pos, tok].tolist())
    return out


# ----------------------------------------------------------------------------------------------- engine


class TransformersEngineConfig(BaseModel):
    """Settings of ``TransformersEngine``."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(
        default=256, ge=1, description="Most sequences (prompts x n) decoded in one batch; more are chunked"
    )
    eos_token_ids: list[int] | None = Field(
        default=None, description="Token ids that end a completion (None: the tokenizer's/model's EOS)"
    )
    pad_token_id: int | None = Field(default=None, description="Padding id (None: the tokenizer's pad/EOS)")
    compact_every: int = Field(
        default=8,
        ge=0,
        description="Every this many decode steps, drop finished sequences from the batch and KV cache when "
        "at least a quarter of them are done (0 = never). Saves compute on uneven lengths.",
    )


class TransformersEngine(Engine):
    """Batched sampling on a transformers causal LM with its KV cache.

    Prompts are left-padded (attention mask + position ids that skip the padding) and prefilled once; the
    cache is then repeated ``n`` times per prompt. Each step samples from ``process_logits`` and stops a
    sequence at its first EOS. Works on any device the model is on, and on bitsandbytes-quantised models.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        config: TransformersEngineConfig | None = None,
    ) -> None:
        self.model = model.eval()
        self.config = config or TransformersEngineConfig()
        self.stats = EngineStats()
        self._lock = threading.Lock()
        eos = self.config.eos_token_ids
        if eos is None:
            eos = []
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos.append(int(tokenizer.eos_token_id))
            gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
                if e is not None and int(e) not in eos:
                    eos.append(int(e))
        if not eos:
            raise ValueError("no EOS token id: pass a tokenizer or TransformersEngineConfig.eos_token_ids")
        self.eos_token_ids = list(eos)
        pad = self.config.pad_token_id
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        # transformers renamed the forward's KV-cache argument (past_key_values -> cache, 5.2x); a model
        # given the other name silently decodes every step without its context
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        from echo_p2p.ml.models import load_weights_

        with self._lock:
            load_weights_(self.model, weights)

    def update_weights(
        self, weights: dict[str, torch.Tensor], changed: Mapping[str, torch.Tensor | None]
    ) -> None:
        """Scatter only the changed values into the model's tensors (in place, no full copy)."""
        from echo_p2p.ml.models import load_weights_

        with self._lock:
            load_weights_(
                self.model, {name: weights[name] for name in changed}, strict=False, positions=changed
            )

    def sample(self, prompt_token_ids: list[list[int]], n: int, params: SamplingParams) -> list[list[Sample]]:
        import torch

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        for i, p in enumerate(prompt_token_ids):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
        seeds = [
            new_seed() if params.seed is None else derive_seed(params.seed, i)
            for i in range(len(prompt_token_ids))
        ]
        per_chunk = max(1, self.config.max_batch_size // n)
        out: list[list[Sample]] = []
        with self._lock:
            timer = _Timer(self.stats)
            with torch.inference_mode():
                for start in range(0, len(prompt_token_ids), per_chunk):
                    out.extend(
                        self._sample_chunk(
                            prompt_token_ids[start : start + per_chunk],
                            n,
                            params,
                            seeds[start : start + per_chunk],
                        )
                    )
            timer.done(sum(len(s.token_ids) for group in out for s in group))
        return out

    def _sample_chunk(
        self, prompts: list[list[int]], n: int, params: SamplingParams, seeds: list[str]
    ) -> list[list[Sample]]:
        import torch
        from transformers import DynamicCache

        device = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
        rows = logits.shape[0]
        next_pos = positions[:, -1].repeat_interleave(n) + 1

        eos = torch.tensor(self.eos_token_ids, device=device)
        # Results per original row; the batch shrinks (compaction) so batch row b is original row active[b].
        tokens = torch.full((rows, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros((rows, params.max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        finished = torch.zeros(rows, dtype=torch.bool, device=device)
        active = torch.arange(rows, device=device)
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # per batch row: still sampling
        every = self.config.compact_every
        # row i * n + k draws completion k of prompt i from its seed's stream (greedy decoding draws nothing)
        seeded = params.temperature > 0
        if seeded:
            draws = torch.tensor(
                [uniforms(seeds[r // n], r % n, params.max_new_tokens) for r in range(rows)],
                dtype=torch.float64,
            )

        for step in range(params.max_new_tokens):
            lp = process_logits(logits, params)
            if params.temperature == 0:
                tok = lp.argmax(dim=-1)
            else:
                tok = draw(lp.exp(), draws[active.cpu(), step]).to(device)
            tok_lp = lp.gather(-1, tok[:, None]).squeeze(-1)
            rows_now = active[alive]
            tokens[rows_now, step] = tok[alive]
            logps[rows_now, step] = tok_lp[alive]
            lengths[rows_now] = step + 1
            done_now = alive & torch.isin(tok, eos)
            finished[active[done_now]] = True
            alive = alive & ~done_now
            if step + 1 == params.max_new_tokens or not bool(alive.any()):
                break
            if every and step % every == every - 1 and int(alive.sum()) <= 0.75 * alive.numel():
                idx = alive.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                active, alive, tok, mask, next_pos = (
                    active[idx],
                    alive[idx],
                    tok[idx],
                    mask[idx],
                    next_pos[idx],
                )
            # finished rows still in the batch decode padding; what they sample is never written
            tok = torch.where(alive, tok, torch.full_like(tok, self.pad_token_id))
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            logits = self.model(
                input_ids=tok[:, None],
                attention_mask=mask,
                position_ids=next_pos[:, None],
                **{self._cache_arg: cache},
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            next_pos = next_pos + 1

        tokens_l, logps_l, lengths_l, finished_l = (
            tokens.tolist(),
            logps.tolist(),
            lengths.tolist(),
            finished.tolist(),
        )
        samples = [
            Sample(
                tokens_l[r][: lengths_l[r]],
                logps_l[r][: lengths_l[r]],
                bool(finished_l[r]),
                seeds[r // n] if seeded else "",
            )
            for r in range(rows)
        ]
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]
