"""Several TRL-style reward functions, called as TRL's ``GRPOTrainer`` calls them and summed with weights.

Owned here: ``RewardTerm`` (one function, its weight and the keyword arguments it takes), ``reward_term``
(builds one, checking the function's signature when the task loads) and ``RewardSum`` (calls every term on a
batch and adds them up). Called by ``tasks.plugin``. Must not import torch.

Behaviour matched against TRL's ``trl/trainer/grpo_trainer.py`` (``_calculate_rewards`` and the weighted
``nansum`` after it; main branch, July 2026). A function is called with keyword arguments only, as TRL
does: ``prompts`` (the prompt texts, or the conversations), ``completions`` (the completion texts, or with
conversational prompts each one as ``[{"role": "assistant", "content": text}]``), ``completion_ids`` (the completions' token ids as sampled, EOS
included if sampled; None when the caller has none, e.g. ``Task.score``), ``trainer_state`` (always None:
there is no Hugging Face ``TrainerState`` here, and a reward that moved with training would not re-score
equal on a trainer at another version), ``log_extra`` and ``log_metric`` (accepted and discarded), and every
other column of the prompt rows, one value per completion. A function with ``**kwargs`` receives all of them;
one without receives only those it names (TRL would raise on the others).

Combined as TRL does (``rewards_per_func * reward_weights``, ``nansum`` over the functions): a completion's
reward is the weighted sum of the functions' values, a function returning None for a completion is left out of
that completion's sum. Unlike TRL, every value is made finite and bounded, because it goes on the wire and
into the trainer's buffer: a NaN, an infinity or a value that is not a number counts as None (TRL turns only
None into NaN and keeps an infinity), a function that raises, returns an awaitable or the wrong number of
values counts as None for the whole batch, a completion for which every function gave None scores 0 (TRL:
NaN, left out of its group's baseline), and values and sums beyond ``MAX_ABS_REWARD`` are clipped to it.
Each kind of problem is logged once per function (then at debug level) and counted in
``RewardSum.problems``.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echo_p2p.rollout import MAX_ABS_REWARD
from echo_p2p.tasks.plugin_loader import PluginError, RewardFunction

logger = logging.getLogger(__name__)

#: The keyword arguments besides the prompt rows' columns that a reward function may receive.
PASSED_ARGUMENTS: tuple[str, ...] = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)
#: Columns never passed (TRL drops them too: they would shadow what the trainer generated).
DROPPED_COLUMNS: tuple[str, ...] = ("completion", "completion_ids")


def _discard(*args: Any, **kwargs: Any) -> None:
    """``log_extra`` / ``log_metric``: TRL logs what a reward function hands them; here they are dropped."""


@dataclass(frozen=True)
class RewardTerm:
    """One reward function of a plug-in task: ``weight`` times its values enters the sum."""

    spec: str  # how the task options named it, for logs
    fn: RewardFunction
    weight: float
    takes: frozenset[str] | None  # the keyword arguments it receives; None: all (it has **kwargs)


def reward_term(spec: str, fn: RewardFunction, weight: float, columns: Sequence[str]) -> RewardTerm:
    """``fn`` as a term of the sum, or ``PluginError`` when it cannot be called as TRL calls it with these
    ``columns``: a required argument that is neither a column nor one of ``PASSED_ARGUMENTS``, a
    positional-only one, no way to see the completion (neither ``completions`` nor ``completion_ids`` nor
    ``**kwargs``), or ``async def``."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        raise PluginError(f"reward function {spec!r} is async: only plain functions are supported here")
    try:
        sig = inspect.signature(fn)
    except (
        TypeError,
        ValueError,
    ):  # builtins without a signature: pass everything, errors surface when called
        return RewardTerm(spec, fn, float(weight), None)
    params = list(sig.parameters.values())
    names = {*PASSED_ARGUMENTS, *columns}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        takes = None
    else:
        keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names = {p.name for p in params if p.kind in keyword_kinds and p.name in names}
        takes = frozenset(names)
        if not names & {"completions", "completion_ids"}:
            raise PluginError(
                f"reward function {spec!r} takes neither `completions` nor `completion_ids` nor **kwargs: "
                "it cannot see the completion it scores"
            )
    try:
        sig.bind(**dict.fromkeys(names))
    except TypeError as exc:
        raise PluginError(
            f"reward function {spec!r} cannot be called as TRL calls a reward function, with keyword "
            f"arguments {list(PASSED_ARGUMENTS)} and the prompt rows' columns {list(columns)} "
            f"(a signature like `f(completions, **kwargs)` always works): {exc}"
        ) from exc
    return RewardTerm(spec, fn, float(weight), takes)


class RewardSum:
    """Calls each term on a batch and returns one finite reward per completion (see the module doc)."""

    def __init__(self, terms: Sequence[RewardTerm]) -> None:
        if not terms:
            raise PluginError("a plug-in task needs at least one reward function")
        self.terms = list(terms)
        #: ``(spec, kind) -> count`` of the problems met: ``raised``, ``not_a_number``, ``non_finite``,
        #: ``too_large`` (clipped), and ``("*", "all_none")`` / ``("*", "sum_too_large")`` for the sum.
        self.problems: Counter[tuple[str, str]] = Counter()

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]] | None,
        columns: Mapping[str, list[Any]],
    ) -> list[float]:
        n = len(completions)
        arguments = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "trainer_state": None,
            "log_extra": _discard,
            "log_metric": _discard,
            **columns,
        }
        per_term = [self._values(term, arguments, n) for term in self.terms]
        rewards = []
        for i in range(n):
            parts = [
                t.weight * values[i]
                for t, values in zip(self.terms, per_term, strict=True)
                if values[i] is not None
            ]
            if not parts:
                self._problem(
                    "*", "all_none", "every reward function gave None for a completion: it scores 0"
                )
                rewards.append(0.0)
                continue
            total = math.fsum(parts)  # |part| <= 1e12 (bounded weight x bounded value): no overflow
            if abs(total) > MAX_ABS_REWARD:
                self._problem(
                    "*", "sum_too_large", f"a weighted sum of {total:.4g}: clipped to ±{MAX_ABS_REWARD:g}"
                )
                total = math.copysign(MAX_ABS_REWARD, total)
            rewards.append(total)
        return rewards

    def _values(self, term: RewardTerm, arguments: Mapping[str, Any], n: int) -> list[float | None]:
        chosen = dict(arguments) if term.takes is None else {k: arguments[k] for k in term.takes}
        try:
            # a copy per call: a function that edits its inputs changes neither the next one's nor the rows
            out = term.fn(**copy.deepcopy(chosen))
            if inspect.isawaitable(out):
                getattr(out, "close", lambda: None)()
                raise TypeError("it returned an awaitable: async reward functions are not supported")
            values = list(out)
            if len(values) != n:
                raise ValueError(f"it returned {len(values)} rewards for {n} completions")
        except Exception as exc:
            self._problem(term.spec, "raised", f"failed ({exc!r}): its term counts 0 in this batch", exc)
            return [None] * n
        return [self._number(term, v) for v in values]

    def _number(self, term: RewardTerm, value: Any) -> float | None:
        if value is None:
            return None
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError("a string")
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            self._problem(term.spec, "not_a_number", f"returned {value!r:.40}, not a number: counted as None")
            return None
        if not math.isfinite(x):
            self._problem(term.spec, "non_finite", f"returned {x}: counted as None")
            return None
        if abs(x) > MAX_ABS_REWARD:
            self._problem(term.spec, "too_large", f"returned {x:.4g}: clipped to ±{MAX_ABS_REWARD:g}")
            return math.copysign(MAX_ABS_REWARD, x)
        return x

    def _problem(self, spec: str, kind: str, message: str, exc: BaseException | None = None) -> None:
        self.problems[(spec, kind)] += 1
        first = self.problems[(spec, kind)] == 1
        where = "reward functions" if spec == "*" else f"reward function {spec}"
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: %s%s",
            where,
            message,
            " (logged once; later ones at debug level)" if first else "",
            exc_info=exc if first and exc is not None else None,
        )
