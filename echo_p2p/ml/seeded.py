"""Seeded sampling: draws that a trainer can replay, so that an edited completion is not a sample.

A completion whose every log-prob is true can still be an edit (a marker appended to a right answer, its
true log-probs reported): statistics can tell it from a sample only once the policy finds the edit unlikely
(``guard.sampling_check``). Seeded sampling makes each token checkable from the first step. A group carries
one seed (``RolloutGroup.sampling_seed``, 128 random bits the sampler picks); token ``t`` of its completion
``k`` is drawn by inverting the sampling distribution's CDF, in token-id order, at the uniform
``u = uniforms(seed, k, ...)[t]``::

    token = the smallest id i with  F(i) > u * F(V - 1),      F(i) = p(0) + ... + p(i)  (float64)

Any fixed order of the vocabulary gives an exact sample of ``p``; the id order (not the order by probability)
keeps the check robust: a sampler whose probabilities differ slightly from the trainer's (bf16, another
batch shape) moves each interval ``[F(t) - p(t), F(t)]`` by at most the summed differences of the tokens
before it, while an order by probability would swap near-ties and move intervals by whole probabilities.

The trainer recomputes ``p`` at each completion token under the version the group claims and checks that
``u`` lies in the token's interval, widened by ``tolerance`` on each side (``interval_misses``). An honest
draw misses only where the sampler's CDF differs from the trainer's by more than ``tolerance``. An edited
token is the draw of its ``u`` with probability ``p(token) + 2 * tolerance`` at most: an edit of two unlikely
tokens is caught almost surely, at the first group that carries it. What a seed does not stop is a sender
that samples many seeds and sends the groups it likes: that is choosing among samples
(``docs/security.md``), which the seed bounds by the sampling it costs (a whole group's draws are fixed by
one seed).

The stream is defined here and nowhere else, independent of torch's generators (a trainer on another
machine, device or torch version replays it): ``uniforms`` is BLAKE2b keyed with the seed, eight 53-bit
uniforms per 64-byte block of the message ``"<k>:<block>"``.

Owned here: ``new_seed``, ``derive_seed``, ``uniforms`` (pure Python), ``draw``, ``interval_distance`` and
``interval_misses`` (torch). Called by ``ml.engine`` (the draw) and ``train.draw_check`` (the replay). Must
not import hivemind.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: A seed on the wire: 128 bits as 32 lowercase hex characters.
SEED_HEX_LEN = 32
SEED_PATTERN = re.compile(r"^[0-9a-f]{32}$")
_PER_BLOCK = 8  # 64-byte digest -> eight 8-byte words
_UNIT = 2.0**-53


def new_seed() -> str:
    """A fresh random seed (hex)."""
    return secrets.token_hex(SEED_HEX_LEN // 2)


def derive_seed(base: int, index: int) -> str:
    """The seed of prompt ``index`` of a call seeded with ``base`` (``SamplingParams.seed``): reproducible."""
    return hashlib.blake2b(f"{base}:{index}".encode(), digest_size=SEED_HEX_LEN // 2).hexdigest()


def uniforms(seed: str, index: int, count: int) -> list[float]:
    """The first ``count`` uniforms in [0, 1) of completion ``index`` of a group seeded with ``seed``."""
    key = bytes.fromhex(seed)
    out: list[float] = []
    block = 0
    while len(out) < count:
        digest = hashlib.blake2b(f"{index}:{block}".encode(), key=key, digest_size=64).digest()
        out.extend((word >> 11) * _UNIT for word in struct.unpack("<8Q", digest))
        block += 1
    return out[:count]


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [rows, V] (the sampling distribution, any float dtype, zeros where
    filtered): the smallest id whose cumulative probability (float64, id order) exceeds ``u * total``."""
    import torch

    cdf = probs.double().cumsum(dim=-1)
    target = (u.to(cdf.device).double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def interval_distance(logp: torch.Tensor, targets: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of ``logp`` [N, V] (the sampling distribution's log-probs at one completion token each), how far
    (in probability mass, float64) the uniform ``u`` [N] falls outside the interval of token ``targets`` [N]:
    0 when the token is the draw of its uniform under this distribution (see the module doc)."""
    p = logp.double().exp()
    cdf = p.cumsum(dim=-1)
    total = cdf[:, -1]
    upper = cdf.gather(1, targets.unsqueeze(1)).squeeze(1) / total
    lower = upper - p.gather(1, targets.unsqueeze(1)).squeeze(1) / total
    x = u.to(p.device).double()
    return (lower - x).clamp_min(0.0) + (x - upper).clamp_min(0.0)


def interval_misses(
    logp: torch.Tensor, targets: torch.Tensor, u: torch.Tensor, tolerance: float
) -> torch.Tensor:
    """Per row: the token is not the draw of its uniform, even with ``tolerance`` of slack on each side of its
    interval (``interval_distance`` above it)."""
    return interval_distance(logp, targets, u) > tolerance
