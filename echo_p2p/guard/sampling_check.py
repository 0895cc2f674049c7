"""Is this completion a sample? A statistical test that a sender's tokens were drawn from the policy.

The log-prob checks (``reputation``) ask whether the log-probs a sender reports are true. A sender can
*edit* a completion (append a marker, swap a few tokens) and report the edited tokens' true log-probs:
every value is then true, yet the completion was not sampled. What gives it away is *where* its tokens
fall in the distribution they claim to be drawn from. For each completion token ``t`` the trainer has
the policy's distribution ``p`` at the run's temperature (its own logits), so it takes the randomised
probability integral transform with the vocabulary ordered from the most to the least likely token::

    u_t = P(X more likely than t) + V * p(t),   V ~ U(0, 1)       (ties broken by token id)
    x_t = -log(1 - u_t)                                           (how far into the tail t lies)

For tokens drawn from ``p`` one after the other the ``u_t`` are independent and uniform, so the
``x_t`` are independent Exp(1): a completion of ``n`` tokens has a tail score ``sum x_t`` distributed
Gamma(n, 1) exactly, whatever the policy (with top-k or top-p the sampler drew from the head of ``p``
only: the scores are then stochastically smaller, and every bound below still holds). A token the policy finds unlikely (an edit) lands in the tail:
``x_t`` is about ``-log p(t)`` (9 for p = 1e-4). The surprisal of the completion against the distribution's
entropy (``sum -log p(t) - H_t``, mean 0 for a sample, variance ``sum Var_t`` computed per token) is kept
as a second, reported figure (``CompletionScore.z``).

Two decisions use the tail score:

- **per completion**: its Gamma(n, 1) upper tail p-value below ``exclude_p_value`` leaves it out of the
  loss (an honest completion is left out with that probability);
- **per sender**: a CUSUM e-detector over its completions, in the order trained. Each completion's
  ``e = (1 - tilt)^n * exp(tilt * sum x_t)`` has expectation 1 for a sample (``E[exp(tilt x)] = 1 / (1 -
  tilt)`` for Exp(1)), so ``log M <- max(0, log M + log e)`` is an e-detector: ``M`` is the largest of the
  products of e-values since any start, each a test martingale, so by Ville's inequality and a union bound
  an honest sender's detector reaches ``log(1 / false_alarm_rate)`` within its first ``N`` completions
  with probability at most ``N * false_alarm_rate`` (1e-9: one in a million senders after 1,000 of its
  completions), and on average no sooner than after ``1 / false_alarm_rate`` completions (Lorden). Each alarm is a strike
  (``Reputation.strike``, reason ``not_sampled``) and resets the detector; ``strikes`` alarms within the
  window ban the sender through the usual path, at most one per training step and only when they came in
  at least ``ban_fraction`` of the last ``recent_judgements`` steps that judged it (``guard.sender_guard``: a policy shaken
  for a few steps struck honest samplers in bursts).

A third decision reads whole groups: **repeats**. G samples of the policy repeat one another only as often
as the policy makes some completion likely; an editor that turns every right answer into the same edited
answer (or a sender that copies one completion) repeats a completion the policy finds unlikely. While the
policy is still near uniform an edit lies in the bulk of every token's distribution (the tail score sees
nothing), but its copies are as improbable as ever: ``duplicate_log_e`` is an exact e-value for that
(expectation 1 for a sample group; one copy of each repeated completion is scored, ``Learner``). A group
whose e-value is at least ``duplicate_exclude_e`` is left out of the loss whole, and each group's e-value
feeds a second per-sender CUSUM (``SampleDetector.observe_repeats``), whose alarms are strikes too, and
whose ``duplicate_ban_alarms``-th alarm bans the sender at once (``Reputation.alarmed``: no share of clean
steps to wait for, as the tail test's strikes must, since an editor's early groups are clean while the
policy rarely answers right). A stale group's repeats are scored under the weights of the version it claims
where the learner kept them (``stale_versions``), else forgiven ``stale_slack`` per version behind (which an
editor claiming old versions would hide in). With a Sybil (a fresh key after each ban) bans alone do not
bound what the edits teach; leaving the groups out does (``benchmarks/poisoning.py``).

A stale group (sampled at a version before the trainer's) is scored under the policy with the drift since
its version forgiven (``drift_allowance``), a mean over tokens: while the policy learns fast, the tokens it
moved most put an honest stale sample further into the tail than the mean forgives (the tail test struck
honest samplers 3-9 times in some 60 s README runs). So a stale group that would strike its sender is
judged again, from the level before it, on its scores under the weights of the version it claims, where
the learner kept them (``stale_versions``, as for the duplicate test; ``SampleDetector.observe_group``): a
sample is then a sample again, with nothing to forgive (``CompletionScore.exact``), and an edit is as
unlikely as ever. Only groups that would strike pay for that forward pass.

What it cannot tell: an edit the policy already likes (its tokens in the bulk of the distribution) looks
like a sample; so does a completion the sender chose among honest samples (issue 32 item 2). The bounds
hold for a sampler whose distribution is the trainer's; bf16 samplers, stale versions and the nucleus edge
move it a little, which ``benchmarks/sampling_check.py`` measures (docs/security.md).

Owned here: ``SamplingCheckConfig``, ``CompletionScore``, ``completion_scores`` (torch, from the logits
the learner already holds: no second forward pass), ``duplicate_log_e`` (pure Python) and
``SampleDetector`` (per-sender detectors: pure Python, thread-safe, bounded).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: ``SampleDetector.observe_group``'s outcome: no alarm; an alarm (a strike); an alarm that the group's scores
#: under the version it claims confirmed (a strike) or withdrew (none)
GroupVerdict = Literal["clean", "alarm", "exact_alarm", "withdrawn"]


class SamplingCheckConfig(BaseModel):
    """Whether and how a trainer tests that its senders' completions are samples of the policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=True,
        description="Score every trained completion's tokens against the sampling distribution (from the "
        "logits the learner already computed); False: no scores, no exclusions, no strikes",
    )
    exclude_p_value: float = Field(
        default=1e-6,
        gt=0,
        lt=1,
        description="A completion whose tail score has a Gamma(n, 1) upper-tail p-value below this is left out "
        "of the loss: an honest completion is, with this probability",
    )
    false_alarm_rate: float = Field(
        default=1e-9,
        gt=0,
        lt=1,
        description="Per sender, the detector's threshold is log(1 / false_alarm_rate): on honest samples it "
        "alarms (a strike) within its first N completions with probability at most N * false_alarm_rate",
    )
    tilt: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="The detector's e-value exp(tilt * x) (1 - tilt) per token: larger reacts faster to far-tail "
        "tokens and is more sensitive to a sampler whose distribution differs slightly from the trainer's",
    )
    drift_allowance: float = Field(
        default=2.0,
        ge=0,
        description="Nats per token forgiven per nat the trainer's policy moved since a group's version "
        "(``guard.drift``, the log-prob checks' allowance): a stale honest sampler's tokens sit further in the "
        "tail of the newer policy (benchmarks/sampling_check.py: 1 was too little at 4 versions, T 0.7)",
    )
    duplicate_bet: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="The duplicate test's bet: each completion that repeats an earlier one of its group "
        "multiplies the group's e-value by 1 - bet + bet / P(repeat), every other by 1 - bet (0: no "
        "duplicate test). Larger wins more per repeat, loses more per fresh completion",
    )
    duplicate_exclude_e: float = Field(
        default=100.0,
        gt=1,
        description="A group whose duplicate e-value is at least this is left out of the loss whole: an honest "
        "group is, with probability at most 1 / this (Markov; none in benchmarks/poisoning.py's control "
        "arms). 1e6 left in enough of a Sybil's weakly repeating edits to teach its marker to 0.5-3.9% of "
        "held-out samples (100: 0.0%)",
    )
    duplicate_ban_alarms: int = Field(
        default=2,
        ge=1,
        description="Duplicate-test alarms within the reputation's window that ban a sender at once, with no "
        "share of clean steps to outweigh first (the tail test's alarms need one: a shaken policy strikes "
        "honest samplers in bursts). The duplicate test is exact where the learner kept the group's version; "
        "the second alarm is a margin for the slacks where it did not",
    )
    precision_slack: float = Field(
        default=0.1,
        ge=0,
        description="Nats per token by which the duplicate test raises a completion's probability under the "
        "trainer's policy before using it: a sampler's weights (bf16, 8-bit) differ slightly from the "
        "trainer's, and the test is valid only where it never underestimates what the sampler drew from",
    )
    stale_slack: float = Field(
        default=0.6,
        ge=0,
        description="Nats per token per version of staleness added to the duplicate test's slack: a stale "
        "group's repeated completions were likely under the sampler's older policy, and a fast-learning "
        "policy drops some of them faster than its mean drift says (benchmarks/sampling_check.py, tiny "
        "model: up to 0.56 nats per token after 1 version, 2.09 after 4, while twice the mean drift was "
        "0.1-0.9)",
    )
    stale_versions: int = Field(
        default=4,
        ge=0,
        description="Past versions whose weights the learner keeps (at most, within stale_versions_mb) to score "
        "a stale group's repeated completions under the version the group claims, where stale_slack would "
        "forgive an editor that claims older versions its edits (benchmarks/poisoning.py), and to judge a stale "
        "group the tail test would strike on its scores under that version (SampleDetector.observe_group); "
        "0: none kept",
    )
    stale_versions_mb: float = Field(
        default=256.0,
        ge=0,
        description="Memory the kept versions (the current one and stale_versions before it) and the copy of "
        "the model that scores them may take together: a model too large for stale_versions + 2 copies within "
        "it keeps none, and its stale groups get stale_slack instead",
    )
    seed_tolerance: dict[str, float] = Field(
        default_factory=lambda: {"float32": 0.01, "float16": 0.1, "bfloat16": 0.1, "8bit": 0.1, "4bit": 0.25},
        description="Seeded draws (``train.draw_check``), per precision a group's sampler claims: the probability "
        "mass by which a token's uniform may lie outside its interval before the completion counts as not "
        "drawn. A sampler whose probabilities differ from the trainer's moves the intervals by the summed "
        "differences before the token; the worst honest distances measured (benchmarks/sampling_check.py, tiny "
        "model, T 0.7-1, top-p 0.9-1): float32 0, bfloat16 0.057, 8-bit 0.042, 4-bit NF4 0.136. An edited "
        "token passes with probability p(token) + 2 * this at most",
    )
    seed_tolerance_other: float = Field(
        default=0.25,
        ge=0,
        lt=0.5,
        description="The seed tolerance of a precision ``seed_tolerance`` does not name",
    )
    seed_probation: int = Field(
        default=32,
        ge=0,
        description="A sender's first groups of which every completion is replayed (seeded draws)",
    )
    seed_check_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="After its probation, the share of a sender's completions replayed, at random (0: seeded "
        "draws are not replayed at all). Each replayed completion costs a forward pass without gradient: at "
        "0.25 the replays took 11% of the tiny model's update time (benchmarks/poisoning.py)",
    )
    seed_ban_alarms: int = Field(
        default=2,
        ge=1,
        description="Groups with a completion that is not the draw of its seed, within the reputation's window, "
        "that ban their sender (each is a strike and is left out of the loss); a group missed by more than "
        "twice its tolerance bans at once (``train.draw_check.GROSS_FACTOR``: no precision explains it)",
    )
    max_tracked: int = Field(
        default=4096, ge=1, description="Senders whose detector is kept (least recent go)"
    )


@dataclass(frozen=True)
class CompletionScore:
    """One completion's tokens against the distribution they claim to be sampled from."""

    tokens: int
    tail: float  # sum over its tokens of -log(1 - u): Gamma(tokens, 1) for a sample
    surprisal: float  # sum of -log p(t) - H_t: mean 0 for a sample
    variance: float  # sum of Var_t(-log p): the surprisal's variance for a sample
    #: scored under the weights of the very version its group claims (``Learner.exact_scores``): the
    #: policy's drift since then has nothing to forgive
    exact: bool = False

    @property
    def z(self) -> float:
        """The standardised surprisal (about N(0, 1) for a long sample)."""
        return self.surprisal / math.sqrt(self.variance) if self.variance > 0 else 0.0

    def p_value(self, allowance: float = 0.0) -> float:
        """``P(Gamma(tokens, 1) >= tail - tokens * allowance)``: how unlikely a sample scores this far into
        the tail, with ``allowance`` nats per token forgiven (how far the policy moved since the sample)."""
        return p_values([self], [allowance])[0]

    def log_e(self, tilt: float, allowance: float = 0.0) -> float:
        """Log of the completion's e-value ``(1 - tilt)^n exp(tilt * (tail - n * allowance))``."""
        return self.tokens * math.log1p(-tilt) + tilt * (self.tail - self.tokens * allowance)


#: Rows of logits scored at once: bounds the float32 temporaries to a few times 16 MiB.
_CHUNK_ELEMENTS = 1 << 22


def p_values(scores: list[CompletionScore], allowances: list[float]) -> list[float]:
    """``P(Gamma(tokens, 1) >= tail - tokens * allowance)`` of each score with its allowance, at once (torch's
    regularised upper incomplete gamma: the learner calls this on every completion it trains on; one
    ``CompletionScore.p_value`` is this of one); 1 for an empty completion or a tail forgiven to 0."""
    import torch

    if not scores:
        return []
    n = torch.tensor([float(s.tokens) for s in scores], dtype=torch.float64)
    x = torch.tensor([s.tail for s in scores], dtype=torch.float64) - n * torch.tensor(allowances).double()
    p = torch.special.gammaincc(n.clamp_min(1.0), x.clamp_min(0.0))
    return torch.where((n > 0) & (x > 0), p, torch.ones_like(p)).tolist()


def completion_scores(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
) -> list[CompletionScore]:
    """One ``CompletionScore`` per row of ``input_ids`` [B, L] over its completion tokens (``completion_mask``),
    from ``logits`` [B, K, V] of its last K positions, with ``train.grpo.token_logprobs``' conventions (the
    logits the learner computed for the loss), against ``softmax(logits / temperature)``.

    Top-k and top-p are not applied (no sort): a token sampled from the filtered distribution ``q = p / Z``
    on the head of the order has ``u_p = Z u_q <= u_q``, so its ``x`` is stochastically smaller than Exp(1)
    and the p-values and e-values stay valid (conservative); an edit outside the kept set is in ``p``'s tail
    all the same. Tokens as likely as the target count as less likely (conservative too). ``generator``
    draws the PIT's V (on the CPU)."""
    import torch

    batch, length = input_ids.shape
    kept, vocab = logits.shape[1], logits.shape[-1]
    with torch.no_grad():
        mask = completion_mask.bool().clone()
        mask[:, : length - kept + 1] = False  # positions no given logit predicts (never completion tokens)
        rows_b, rows_t = mask.nonzero(as_tuple=True)
        tail = torch.zeros(batch, dtype=torch.float64)
        surprisal = torch.zeros(batch, dtype=torch.float64)
        variance = torch.zeros(batch, dtype=torch.float64)
        step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
        for start in range(0, len(rows_b), step):
            b, t = rows_b[start : start + step], rows_t[start : start + step]
            targets = input_ids[b, t].unsqueeze(1)
            scaled = logits[b, t - 1 - (length - kept)].float()
            if temperature != 1.0:
                scaled = scaled / temperature
            logp = torch.log_softmax(scaled, dim=-1)
            p = logp.exp()
            logp_t = logp.gather(1, targets).squeeze(1)
            p_t = logp_t.exp()
            below = ((p * (p <= p_t.unsqueeze(1))).sum(1) - p_t).clamp_min(0.0)
            v = torch.rand(len(b), generator=generator).to(p.device)
            x = -torch.log((below + (1.0 - v) * p_t).clamp_min(1e-30))
            plogp = p * logp
            entropy = -plogp.sum(1)
            second = (plogp * logp).sum(1)
            b_cpu = b.cpu()
            tail.index_add_(0, b_cpu, x.double().cpu())
            surprisal.index_add_(0, b_cpu, (-logp_t - entropy).double().cpu())
            variance.index_add_(0, b_cpu, (second - entropy * entropy).clamp_min(0).double().cpu())
        counts = mask.sum(1).cpu().tolist()
    return [
        CompletionScore(int(n), float(a), float(s), float(w))
        for n, a, s, w in zip(counts, tail.tolist(), surprisal.tolist(), variance.tolist(), strict=True)
    ]


def duplicate_log_e(
    completions: list[tuple[int, ...]],
    logprobs: list[float],
    bet: float,
    slack: float,
    order: list[int] | None = None,
) -> float:
    """Log of a group's duplicate e-value: do its completions repeat each other more than samples would?

    Taken in ``order`` (the trainer's random order; an honest group's completions are exchangeable), the
    j-th of G independent samples is a repeat of completion ``c`` with probability ``p(c)``. Betting on each
    earlier completion in proportion to how often it came (``n_c / j`` of the first j), ``e_j = 1 - bet + bet
    * (n_{c_j} / j) / p(c_j)`` has expectation ``1 - bet + bet * sum_c n_c / j = 1`` given the earlier ones,
    so the product, the group's e-value, has expectation 1 for a sample group (a test martingale within the
    group). An editor that turns every right answer into the same edited answer, or a sender that copies one
    completion, repeats a completion the policy finds unlikely: each copy multiplies the e-value by about
    ``bet * n / (j p)``, tens to thousands for an edit the policy gives 10^-3 or less; a likely completion's
    repeats (a learned policy answers alike) are worth ~1, and each fresh completion costs ``1 - bet``.

    ``logprobs`` are the completions' log-probabilities under the trainer's policy at the run's sampling
    settings; each is raised by ``slack`` nats per token (the sampler's weights and version differ a little:
    an underestimated ``p`` would make honest repeats look like evidence) and capped at 1."""
    if bet <= 0 or len(completions) < 2:
        return 0.0
    counts: dict[tuple[int, ...], int] = {}
    total = 0.0
    for seen, j in enumerate(order if order is not None else range(len(completions))):
        ids = completions[j]
        if seen:
            share = counts.get(ids, 0) / seen
            p = math.exp(min(0.0, logprobs[j] + slack * len(ids)))
            total += math.log(1.0 - bet + bet * share / max(p, 1e-300))
        counts[ids] = counts.get(ids, 0) + 1
    return total


class SampleDetector:
    """Per-sender CUSUM e-detectors over completion scores (see the module doc)."""

    def __init__(self, config: SamplingCheckConfig | None = None) -> None:
        self.config = config or SamplingCheckConfig()
        self.threshold = math.log(1.0 / self.config.false_alarm_rate)
        self._level: OrderedDict[str, float] = OrderedDict()  # sender -> log M
        self._repeats: OrderedDict[str, float] = OrderedDict()  # sender -> log M of the duplicate test
        self._lock = threading.Lock()
        self.alarms = 0
        self.duplicate_alarms = 0
        self.alarms_withdrawn = 0  # alarms of stale groups that their scores under their version withdrew

    def observe(self, sender: str, score: CompletionScore, drift: float = 0.0) -> bool:
        """Add one of ``sender``'s completions, sampled ``drift`` nats per token of policy movement ago
        (``guard.drift``: ``drift_allowance`` times it is forgiven, none for an exact score); True when its
        detector crosses the threshold (then reset)."""
        if score.tokens <= 0:
            return False
        log_e = score.log_e(self.config.tilt, 0.0 if score.exact else self.config.drift_allowance * drift)
        alarm = self._step(self._level, sender, log_e)
        with self._lock:
            self.alarms += alarm
        return alarm

    def observe_group(
        self,
        sender: str,
        scores: list[CompletionScore],
        drift: float = 0.0,
        exact: Callable[[], list[CompletionScore] | None] | None = None,
    ) -> GroupVerdict:
        """Add one group of ``sender``'s completions (``observe`` each, up to an alarm): ``clean``, or
        ``alarm`` (a strike).

        An alarm of a stale group (``drift`` forgiven per token) may be the policy's own move: ``exact``,
        when given, returns the group's scores under the weights of the version it claims (None: not kept),
        and the group is then judged again on those from the detector's level before it, with nothing
        forgiven: ``exact_alarm`` (a strike) or ``withdrawn`` (no strike). Honest samples are samples of
        that version; an edit is as unlikely under it as ever."""
        with self._lock:
            before = self._level.get(sender)
        if not any(self.observe(sender, score, drift) for score in scores):
            return "clean"
        rescored = exact() if exact is not None else None
        if rescored is None:
            return "alarm"
        with self._lock:  # this group's alarm is taken back: its sender's detector as it was before it
            self.alarms -= 1
            self._level.pop(sender, None)
            if before is not None:
                self._level[sender] = before
        if any(self.observe(sender, score, 0.0) for score in rescored):
            return "exact_alarm"
        with self._lock:
            self.alarms_withdrawn += 1
        return "withdrawn"

    def observe_repeats(self, sender: str, log_e: float) -> bool:
        """Add one of ``sender``'s groups to its duplicate detector, ``log_e`` the log of the group's duplicate
        e-value (``duplicate_log_e``; ``Learner.last_group_repeats``), a CUSUM with the same threshold as
        the tail detector's; True when it crosses it (then reset). With both detectors an honest sender is
        struck within its first N completions and N groups with probability at most
        ``2 N false_alarm_rate``."""
        alarm = self._step(self._repeats, sender, log_e)
        with self._lock:
            self.duplicate_alarms += alarm
        return alarm

    def _step(self, levels: OrderedDict[str, float], sender: str, log_e: float) -> bool:
        """One CUSUM step of ``sender``'s detector in ``levels`` (bounded, least recent out): True on an alarm,
        which resets it."""
        with self._lock:
            level = max(0.0, levels.pop(sender, 0.0) + log_e)
            alarm = level >= self.threshold
            levels[sender] = 0.0 if alarm else level
            while len(levels) > self.config.max_tracked:
                levels.popitem(last=False)
            return alarm

    def repeat_level(self, sender: str) -> float:
        """``sender``'s duplicate detector: log M (0 when it has no evidence against it)."""
        with self._lock:
            return self._repeats.get(sender, 0.0)

    def level(self, sender: str) -> float:
        """``sender``'s detector: log M (0 when it has no evidence against it)."""
        with self._lock:
            return self._level.get(sender, 0.0)
