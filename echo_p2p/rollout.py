"""Rollout groups: the typed record that inference peers produce and trainers consume.

Owned here: the schema of one group of ``G`` completions of one prompt, sampled at one policy version,
and its single serializer (msgpack via pydantic). Used by the engines' callers (inference peer), the
rollout transport (networking) and the trainer (validation, replay buffer, GRPO).
Must not import torch or hivemind: it is a plain data record. Unknown fields are ignored on parse, so a
newer peer may add fields.
"""

from __future__ import annotations

import hashlib
import uuid

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echo_p2p import PROTOCOL_VERSION

#: Largest reward magnitude on the wire. Rewards are any finite real (a TRL-style length penalty or a -1..1
#: correctness score keeps its meaning), but every message from a peer is untrusted, so a claimed reward is
#: bounded: a record with ``|claimed_reward| > MAX_ABS_REWARD`` (or NaN, or infinity) does not parse. Tasks
#: keep their rewards within it (``tasks.plugin`` clips a user function's values to it and logs).
MAX_ABS_REWARD = 1e6

#: Longest ``rollout_id`` accepted (a uuid4 hex is 32 characters).
MAX_ROLLOUT_ID_LEN = 64


class Completion(BaseModel):
    """One sampled completion of a prompt."""

    model_config = ConfigDict(extra="ignore")

    token_ids: list[int] = Field(
        description="Completion token ids (no prompt, no padding); EOS included if sampled"
    )
    logprobs: list[float] = Field(
        description="Behaviour log-prob of each sampled token under the sampling distribution, same length as token_ids"
    )
    claimed_reward: float = Field(
        ge=-MAX_ABS_REWARD,
        le=MAX_ABS_REWARD,
        allow_inf_nan=False,
        description="Reward computed by the sampler, any finite float in [-MAX_ABS_REWARD, MAX_ABS_REWARD] "
        "(1e6); trainers re-score and never trust it",
    )
    finished: bool = Field(
        default=True, description="True when the completion ended with EOS (not truncated)"
    )


class Sampling(BaseModel):
    """How a group's completions were sampled. The trainer computes its log-probs under the same distribution
    (temperature, top-k, top-p) and refuses settings the run does not allow (``guard.rollout_checks``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: float = Field(description="Softmax temperature the tokens were drawn at")
    top_p: float = Field(default=1.0, description="Nucleus mass (1 = off)")
    top_k: int = Field(default=0, description="Top-k (0 = off)")
    engine: str = Field(default="", max_length=32, description="Sampling engine: transformers or vllm")
    precision: str = Field(
        default="", max_length=32, description="Sampler's weights: float32, bfloat16, float16, 8bit or 4bit"
    )


class RolloutGroup(BaseModel):
    """``G`` completions of one prompt sampled by one policy version."""

    model_config = ConfigDict(extra="ignore")

    protocol: int = Field(default=PROTOCOL_VERSION, description="Wire protocol version")
    rollout_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex, description="Unique id, for de-duplication"
    )
    task: str = Field(description="Name of the task that made the prompt and scores the completions")
    prompt_id: int = Field(description="Deterministic prompt id: the task rebuilds the prompt from it")
    prompt_token_ids: list[int] = Field(description="Prompt token ids as the sampler tokenized them")
    completions: list[Completion] = Field(description="The G completions of this prompt")
    policy_version: int = Field(description="Policy version that sampled every completion of the group")
    sampler_peer_id: str = Field(
        default="", description="Peer id (base58) of the inference peer that sampled it"
    )
    sampled_at: float = Field(default=0.0, description="Sampler's wall-clock time when the group finished")
    sampling: Sampling | None = Field(
        default=None, description="How the completions were sampled (None: not said; a trainer refuses it)"
    )
    weights_stream: str = Field(
        default="",
        max_length=64,
        description="The publisher stream (``PolicyWeights.stream_id``) of the weights of ``policy_version`` "
        "that sampled it: two trainers may publish the same version number from two lineages at once, and a "
        "trainer replays a group's draws only under weights it knows to be these; empty: not said",
    )
    sampling_seed: str = Field(
        default="",
        pattern=r"^([0-9a-f]{32})?$",
        description="The seed its completions were drawn from (``ml.seeded``: completion k is draw k of it, "
        "which a trainer replays); empty: not drawn from a seed (a run with ``seeded_sampling`` refuses it)",
    )

    @property
    def group_size(self) -> int:
        return len(self.completions)

    def content_key(self) -> bytes:
        """A digest of what the group *is* (task, prompt and the set of completion token sequences), whatever
        its ``rollout_id``, the version it claims and the order of its completions: the same completions sent
        again under a new id, relabelled with another version or shuffled are recognised by it."""
        completions = sorted(c.token_ids for c in self.completions)
        body = [self.task, self.prompt_id, completions]
        return hashlib.sha256(msgpack.packb(body, use_bin_type=True)).digest()

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @staticmethod
    def max_wire_bytes(prompt_tokens: int, group_size: int, completion_tokens: int) -> int:
        """Most bytes ``to_bytes`` can take for a group within these limits (a token id is at most 5 msgpack
        bytes, a log-prob 9, 128 per completion and 1 KiB per group for the rest): receivers refuse larger
        messages before parsing them."""
        return 1024 + 5 * prompt_tokens + group_size * (128 + 14 * completion_tokens)

    @classmethod
    def from_bytes(cls, data: bytes) -> RolloutGroup:
        """Parse untrusted bytes; raises ``ValueError`` on bad input, its message one line naming the first
        bad field (e.g. ``completions.0.claimed_reward: Input should be a finite number``)."""
        try:
            obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ValueError(f"not a msgpack record: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError("rollout record must be a map")
        try:
            return cls.model_validate(obj)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(map(str, first["loc"])) or "record"
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            raise ValueError(f"{where}: {first['msg']}{more}") from exc
