"""Why a trainer refuses a rollout group: the codes on the rollout wire.

Owned here: ``Reason`` (the closed set of refusal codes: the string a sender receives in a push's or a sample
answer's status, and the name of the trainer's per-sender counter), which of them a sender may retry
elsewhere or later (``RETRYABLE_REASONS``) or meets in routine (``ROUTINE_REASONS``), and ``Rejection`` (a
code and a short detail). Written by the trainer's checks (``guard``) and transport (``rollouts.ingest``,
``rollouts.pull``), read by the inference side (``rollouts.push``). Pure Python: no torch, no hivemind.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Reason(str, Enum):
    """Why a rollout group was refused. The value is what the sender receives and what counters are named."""

    MALFORMED = "malformed"  # does not parse, wrong types, empty completion, bad id or negative version
    OTHER_PROTOCOL = "other_protocol"  # written by a peer of another protocol version
    UNKNOWN_TASK = "unknown_task"  # a task this trainer does not train on
    BAD_PROMPT_ID = "bad_prompt_id"  # prompt id out of the task's range
    HELD_OUT = "held_out"  # a prompt of the task's held-out split: evaluated, never trained on
    PROMPT_MISMATCH = "prompt_mismatch"  # prompt tokens differ from the prompt rebuilt from its id
    WRONG_GROUP_SIZE = "wrong_group_size"  # not exactly ``group_size`` completions
    TOKEN_OUT_OF_RANGE = "token_out_of_range"  # a token id outside [0, vocab_size)
    TOO_LONG = "too_long"  # prompt or completion longer than the limits
    LOGPROB_MISMATCH = "logprob_mismatch"  # not one log-prob per completion token
    BAD_LOGPROB = "bad_logprob"  # a log-prob > 0 (impossible) or below the floor (``logprob_floor_mass``)
    NON_FINITE = "non_finite"  # NaN or infinity in log-probs or the claimed reward
    FUTURE_VERSION = "future_version"  # sampled by a policy version this trainer has not reached
    TOO_STALE = "too_stale"  # older than ``max_staleness`` versions
    FORGED_REWARD = "forged_reward"  # a claimed reward differs from the verifier's re-score
    DUPLICATE = "duplicate"  # a rollout id already accepted (a resend: counted, acknowledged as delivered)
    BUFFER_FULL = "buffer_full"  # the trainer has no room now (retryable elsewhere)
    TOO_LARGE = "too_large"  # a message above the byte limit
    TOO_MANY = "too_many"  # more groups in one push than allowed
    DUPLICATE_CONTENT = "duplicate_content"  # the completions of a group already accepted, under a new id
    NOT_THE_SAMPLER = "not_the_sampler"  # ``sampler_peer_id`` names another peer than the one pushing it
    SAMPLING_MISMATCH = "sampling_mismatch"  # sampled with settings the run does not allow (or none said)
    NO_SIGNAL = "no_signal"  # valid, but every completion re-scored the same: nothing to learn (advantage 0)
    NOT_GRANTED = "not_granted"  # beyond the sender's grant and its allowance (paced trainers; retryable)
    INTERNAL_ERROR = "internal_error"  # the trainer failed while checking it (a bug; logged)


#: Reasons after which the same group may succeed at another trainer (or later): the sender resends.
RETRYABLE_REASONS: frozenset[Reason] = frozenset(
    {Reason.BUFFER_FULL, Reason.INTERNAL_ERROR, Reason.NOT_GRANTED}
)
#: Refusals an honest sampler meets in routine (a policy that is always right, a stale group): counted, not
#: logged as warnings by the sender, and never a strike.
ROUTINE_REASONS: frozenset[Reason] = frozenset({Reason.TOO_STALE, Reason.NO_SIGNAL})


@dataclass(frozen=True)
class Rejection:
    """A refused group: the reason (a fixed code) and a short detail for logs and the sender."""

    reason: Reason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value
