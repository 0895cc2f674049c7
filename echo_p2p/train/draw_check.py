"""Replay of seeded draws: is each completion the draw that its group's seed makes? (``ml.seeded``)

A group drawn from a seed fixes every token of its completions: token ``t`` of completion ``k`` is where
the uniform ``uniforms(seed, k)[t]`` falls in the sampling distribution's CDF. A trainer replays that for the
completions it picks: the logits of the version the group claims at each completion token, the run's
temperature, top-k and top-p (``ml.engine.process_logits``, the sampler's own maths), and each token's interval
checked against its uniform with ``seed_tolerance`` of slack (``ml.seeded.interval_distance``). A completion
with a token outside is not a sample of that seed: an edit, whatever its log-probs say. Its group is left out
of the loss whole and its sender struck (``guard.sender_guard``).

Where the logits come from: a group at the version being trained is replayed from the loss's own forward pass
(``BatchReplay.from_logits``: the same weights, rounded to the policy's precision, at no forward of its own);
a group at an older version, or one whose rows the learner splits between micro-batches, by a forward pass
without gradient under the weights the learner kept (``train.past_weights``) or the policy's, before the loss.

What is replayed: every completion of a sender's first ``seed_probation`` groups, then each completion with
probability ``seed_check_share`` (a forward pass of its own costs about a third of a training step's per
completion, so checking all of the older ones would cost the trainer a quarter of its speed). Those that need a
pass of their own are picked at one or a few versions per batch, drawn at random, at a share raised to match
(``DrawCheck.pick``): the same chance for every completion, with one pass where a batch of an async run spans
several versions (the fixed cost of a forward call is what a small model's replays spent). An editor present
from the run's first step is replayed in full; one that starts later edits each group's right answers, and each
edited completion is picked with that probability. A group whose version's weights are not at hand (older than
the kept versions, or a model too large to keep any) is not replayed (``unchecked``).

Owned here: ``DrawCheck``, ``BatchReplay``. Called by ``train.learner`` around a batch's loss. Must not import hivemind.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from echo_p2p.ml.engine import SamplingParams, process_logits
from echo_p2p.ml.seeded import interval_distance, uniforms
from echo_p2p.train.batching import groups_in_one_micro_batch
from echo_p2p.train.forward import forward_rows

if TYPE_CHECKING:  # pragma: no cover
    from echo_p2p.guard.sampling_check import SamplingCheckConfig
    from echo_p2p.train.batching import Batch
    from echo_p2p.train.config import DerivedSettings
    from echo_p2p.train.forward import RowsReader
    from echo_p2p.train.scored import ScoredGroup

#: The model holding a policy version's weights, or None when they are not at hand
ModelAt = Callable[[int], "torch.nn.Module | None"]

#: Logit elements (tokens x vocabulary) turned into sampling distributions at once
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class Replay:
    """What the replay of one group's picked completions found."""

    missed: int  # completions with a token whose uniform lies outside its interval by more than ``tolerance``
    worst: float  # the farthest any of their tokens' uniforms lay outside its interval (probability mass)
    tolerance: (
        float  # the slack its sampler's claimed precision gets (``SamplingCheckConfig.seed_tolerance``)
    )

    @property
    def gross(self) -> bool:
        """Missed by more than ``GROSS_FACTOR`` times the tolerance: no precision explains it."""
        return self.missed > 0 and self.worst > GROSS_FACTOR * self.tolerance


#: A miss beyond this many times its tolerance is proof (honest samplers' worst distance stayed below half
#: their tolerance in benchmarks/sampling_check.py): its sender is banned at once
GROSS_FACTOR = 2.0


class DrawCheck:
    """Picks the completions to replay and replays them (see the module doc)."""

    def __init__(
        self, config: SamplingCheckConfig, derived: DerivedSettings, seed: int | None = None
    ) -> None:
        self.config = config
        self.derived = derived
        self.params = SamplingParams(
            temperature=derived.temperature, top_p=derived.top_p, top_k=derived.top_k, max_new_tokens=1
        )
        self._rng = random.Random(secrets.randbits(64) if seed is None else seed)
        self._groups_seen: OrderedDict[str, int] = OrderedDict()  # sender -> groups picked from so far
        self.replayed = 0  # completions replayed
        self.missed = 0  # of them, not the draws of their seed
        self.unchecked = 0  # seeded groups whose version's weights were not at hand
        self.seconds = 0.0  # spent replaying (what the check costs the trainer)
        #: the farthest any replayed token's uniform fell outside its interval (calibration of seed_tolerance
        #: on honest samplers; an edit's is large)
        self.largest_distance = 0.0

    def pick(
        self,
        groups: Sequence[ScoredGroup],
        own_pass: Callable[[int], bool] | None = None,
        free: frozenset[int] = frozenset(),
    ) -> list[list[int]]:
        """Per group, the indices of the completions to replay (none for a group without a seed).

        ``own_pass(g)``: whether group ``g``'s replay needs a forward pass of its own (a group at an older version,
        or one split between micro-batches; None: none does). Every completion of a sender's first
        ``seed_probation`` groups is picked; after it, each completion with probability ``seed_check_share``.
        Those needing a pass of their own are picked at few versions per batch: the versions that no
        probation group, nor another check (``free``: the duplicate test's passes), brings to a pass anyway are
        the candidates; ``k = ceil(share * m)`` of the ``m`` are
        drawn uniformly at random, and each completion of theirs is picked with probability ``share * m / k``.
        Any completion is still picked with probability ``share`` whatever version its group claims (a rare
        version is as likely drawn as a common one), but a batch costs at most ``k`` forward passes (one while
        ``m <= 1 / share``) instead of one per version."""
        share = self.config.seed_check_share
        out: list[list[int]] = []
        later: list[int] = []  # groups past their sender's probation
        for index, scored in enumerate(groups):
            group = scored.group
            if not group.sampling_seed or share <= 0:
                out.append([])
                continue
            sender = group.sampler_peer_id
            seen = self._groups_seen.pop(sender, 0)
            self._groups_seen[sender] = seen + 1
            while len(self._groups_seen) > self.config.max_tracked:
                self._groups_seen.popitem(last=False)
            if seen < self.config.seed_probation:
                out.append(list(range(len(group.completions))))
            else:
                out.append([])
                later.append(index)
        needs = own_pass or (lambda g: False)
        passes = {groups[g].policy_version for g, p in enumerate(out) if p and needs(g)} | free
        candidates = sorted({groups[g].policy_version for g in later if needs(g)} - passes)
        focus: set[int] = set()
        rate = share
        if candidates:
            drawn = math.ceil(share * len(candidates) - 1e-9)
            focus = set(self._rng.sample(candidates, drawn))
            rate = share * len(candidates) / drawn
        for g in later:
            version = groups[g].policy_version
            if needs(g) and version not in passes:
                p = rate if version in focus else 0.0
            else:
                p = share
            out[g] = [k for k in range(len(groups[g].group.completions)) if self._rng.random() < p]
        return out

    def tolerance(self, scored: ScoredGroup) -> float:
        """The slack of a group's replay: the one its sampler's claimed precision needs, and at least the 8-bit
        one where the samplers got the weights through a lossy 8-bit encoding (``DerivedSettings.lossy_weights``:
        the honest samplers of a local run with the default ``auto`` encoding missed by 0.033-0.046)."""
        sampling = scored.group.sampling
        precision = sampling.precision if sampling is not None else ""
        table, other = self.config.seed_tolerance, self.config.seed_tolerance_other
        tolerance = table.get(precision, other)
        return max(tolerance, table.get("8bit", other)) if self.derived.lossy_weights else tolerance

    def misses(
        self, groups: Sequence[ScoredGroup], picks: list[list[int]], model_at: ModelAt
    ) -> list[Replay | None]:
        """Per group, what the replay of its picked completions found (``Replay.missed``: those that are not the
        draws of its seed); None when nothing was replayed (no seed, none picked, or its version's weights not
        at hand)."""
        started = time.perf_counter()
        out: list[Replay | None] = [None] * len(groups)
        by_version: dict[int, list[tuple[int, int]]] = {}
        for index, (scored, picked) in enumerate(zip(groups, picks, strict=True)):
            for k in picked if scored.group.sampling_seed else ():
                by_version.setdefault(scored.policy_version, []).append((index, k))
        for version, rows in sorted(by_version.items()):
            model = model_at(version)
            if model is None:
                self.unchecked += len({index for index, _ in rows})
                continue
            forward_rows(
                model,
                self.sequences(groups, rows),
                self.derived.pad_token_id,
                self.derived.policy_precision,
                [self.reader(groups, rows, 0, out)],
            )
        self.seconds += time.perf_counter() - started
        return out

    @staticmethod
    def sequences(
        groups: Sequence[ScoredGroup], rows: list[tuple[int, int]]
    ) -> list[tuple[list[int], list[int]]]:
        """The (prompt, completion) token ids of ``rows`` (group index, completion index)."""
        return [
            (list(groups[i].group.prompt_token_ids), list(groups[i].group.completions[k].token_ids))
            for i, k in rows
        ]

    def reader(
        self, groups: Sequence[ScoredGroup], rows: list[tuple[int, int]], first: int, out: list[Replay | None]
    ) -> RowsReader:
        """A ``forward.forward_rows`` reader that replays ``rows`` (rows ``first`` on of the pass) into
        ``out``."""

        def read(start: int, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
            lo, hi = max(first, start), min(first + len(rows), start + int(input_ids.shape[0]))
            if lo < hi:
                part, at = rows[lo - first : hi - first], [i - start for i in range(lo, hi)]
                self.replay_logits(groups, part, at, logits, int(input_ids.shape[1]), out, timed=False)

        return read

    def replay_logits(
        self,
        groups: Sequence[ScoredGroup],
        rows: list[tuple[int, int]],
        at: list[int],
        logits: torch.Tensor,
        width: int,
        out: list[Replay | None],
        timed: bool = True,
    ) -> None:
        """Replay ``rows`` (group index, completion index) from the logits a forward pass under the weights of
        their groups' version already made (the loss's own, or a pass shared with the duplicate test): ``logits``
        of the last positions of a right-padded batch ``width`` columns wide, ``at[i]`` the batch row of
        ``rows[i]``. What each group's replay found goes into ``out`` (as ``misses`` returns it); ``timed``: the
        seconds it takes count in ``seconds`` (not where the caller counts the pass's)."""
        if not rows:
            return
        started = time.perf_counter()
        with torch.no_grad():
            worst = self._worst(groups, rows, at, logits.detach(), width - logits.shape[1])
        for (index, _), far in zip(rows, worst, strict=True):
            self._record(groups, out, index, far)
        if timed:
            self.seconds += time.perf_counter() - started

    def _record(
        self, groups: Sequence[ScoredGroup], out: list[Replay | None], index: int, worst: float
    ) -> None:
        """Count one replayed completion of group ``index`` whose tokens lay at most ``worst`` outside."""
        tolerance = self.tolerance(groups[index])
        before = out[index] or Replay(0, 0.0, tolerance)
        missed = worst > tolerance
        self.replayed += 1
        self.missed += missed
        out[index] = Replay(before.missed + missed, max(before.worst, worst), tolerance)

    def _worst(
        self,
        groups: Sequence[ScoredGroup],
        rows: list[tuple[int, int]],
        at: list[int],
        logits: torch.Tensor,
        offset: int,
    ) -> list[float]:
        """Per (group index, completion index) in ``rows``, held in row ``at[i]`` of ``logits`` (right-padded
        prompt + completion; ``logits[:, j]`` is position ``offset + j``): the farthest its tokens' uniforms
        lie outside their intervals. The sampling distributions are made a bounded number of tokens at a time."""
        device = logits.device
        rows_at: list[int] = []  # per completion token: its row in the batch, its logit position
        positions: list[int] = []
        targets: list[int] = []
        draws: list[float] = []
        lengths: list[int] = []
        for (index, k), row in zip(rows, at, strict=True):
            group = groups[index].group
            prompt, completion = len(group.prompt_token_ids), list(group.completions[k].token_ids)
            rows_at += [row] * len(completion)
            positions += range(prompt - 1 - offset, prompt + len(completion) - 1 - offset)
            targets += completion
            draws += uniforms(group.sampling_seed, k, len(completion))
            lengths.append(len(completion))
        per = max(1, _CHUNK_ELEMENTS // int(logits.shape[-1]))
        parts: list[torch.Tensor] = []
        for start in range(0, len(targets), per):
            stop = start + per
            rows_t = torch.tensor(rows_at[start:stop], dtype=torch.long, device=device)
            at_t = torch.tensor(positions[start:stop], dtype=torch.long, device=device)
            logp = process_logits(logits[rows_t, at_t], self.params)
            parts.append(
                interval_distance(
                    logp, torch.tensor(targets[start:stop], device=device), torch.tensor(draws[start:stop])
                ).cpu()
            )
            del logp
        distance = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
        if len(distance):
            self.largest_distance = max(self.largest_distance, float(distance.max()))
        return [float(d.max()) if len(d) else 0.0 for d in distance.split(lengths)]


class BatchReplay:
    """The replay of one batch's picked completions, made while the learner computes its loss.

    A group at the version being trained whose rows all lie in one micro-batch is replayed from the logits of
    that micro-batch's loss (``from_logits``, called for every micro-batch in order): the check costs it no
    forward pass. The others (older versions, from the kept weights; a group split between micro-batches,
    whose replay must be complete before the first part's backward, since it is left out of the loss whole)
    are replayed ahead of the loss: ``ahead`` names them per weights, and the learner reads them
    (``DrawCheck.reader``) in the passes it makes for the duplicate test under the same weights
    (``train.repeat_check``). They are picked at few versions per batch (``DrawCheck.pick``), among those the
    duplicate test does not pass anyway (``free``); ``at_hand(v)``: whether version ``v``'s weights are held
    (a group at one that is not is ``unchecked``). ``misses``: per group, what its replay found so far."""

    def __init__(
        self,
        check: DrawCheck,
        groups: Sequence[ScoredGroup],
        micro: Sequence[Batch],
        current_version: int | None,
        at_hand: Callable[[int], bool],
        free: frozenset[int] = frozenset(),
    ) -> None:
        self.check, self.groups = check, groups
        self.in_loss = {
            g
            for g in groups_in_one_micro_batch(micro)
            if groups[g].group.sampling_seed
            and (current_version is None or groups[g].policy_version == current_version)
        }
        self.picks = check.pick(
            groups, lambda g: g not in self.in_loss and at_hand(groups[g].policy_version), free
        )
        self.starts = [0]  # each group's first row in the batch (rows: groups in order, then completions)
        for scored in groups:
            self.starts.append(self.starts[-1] + len(scored.group.completions))
        self.misses: list[Replay | None] = [None] * len(groups)
        #: the picked completions replayed ahead of the loss, per weights (None: the policy's; a version: the
        #: weights kept for it)
        self.ahead: dict[int | None, list[tuple[int, int]]] = {}
        for g, picked in enumerate(self.picks):
            if g in self.in_loss or not picked:
                continue
            version = groups[g].policy_version
            if not at_hand(version):
                check.unchecked += 1
                continue
            key = None if current_version is None or version == current_version else version
            self.ahead.setdefault(key, []).extend((g, k) for k in picked)
        self._row0 = 0  # the batch row of the next micro-batch's first

    def from_logits(self, mb: Batch, logits: torch.Tensor) -> bool:
        """Replay the picked completions of ``mb`` (the next micro-batch) whose groups are replayed in the loss,
        from its ``logits`` (those of the last positions); True when any was."""
        row0, self._row0 = self._row0, self._row0 + mb.num_sequences
        rows = [
            (g, row0 + r - self.starts[g])
            for r, g in enumerate(mb.group_index.tolist())
            if g in self.in_loss and row0 + r - self.starts[g] in self.picks[g]
        ]
        at = [self.starts[g] + k - row0 for g, k in rows]
        self.check.replay_logits(self.groups, rows, at, logits, int(mb.input_ids.shape[1]), self.misses)
        return bool(rows)
