"""Configs and the RPC namespace of the rollout transport (push ingest and sync pull), free of torch and hivemind.

The CLIs validate every config before anything heavy starts, so these classes live apart from the
servicers that use them (``rollouts/ingest.py``, ``rollouts/push.py``, ``rollouts/pull.py``, ``rollouts/sample.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.net.keys import SwarmKeys

#: Largest serialized rollout group that one stream message may carry (hivemind caps a message at 4 MiB).
MAX_GROUP_BYTES = 3 * 1024 * 1024


def rollout_namespace(keys: SwarmKeys) -> str:
    """The RPC namespace of a run's rollout handlers (peers of two runs sharing a p2pd never mix)."""
    return f"echo-v{keys.protocol}-{keys.run_id}-rollouts"


class IngestServerConfig(BaseModel):
    """Limits of a trainer's rollout ingest RPC."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_groups_per_push: int = Field(
        default=64, ge=1, description="Groups read from one push; the rest unread"
    )
    max_group_bytes: int = Field(
        default=MAX_GROUP_BYTES, ge=1024, description="Largest serialized group parsed (bytes)"
    )
    stream_timeout: float = Field(default=30.0, gt=0, description="Deadline (s) to read one push stream")
    ack_linger: float = Field(
        default=5.0,
        gt=0,
        description="Seconds a push stream is kept open after its ack, for the sender to close it first (a "
        "stream its receiver closes first can be reset, and the reset can overtake the ack)",
    )
    refuse_when_full: bool = Field(
        default=True,
        description="Refuse (buffer_full, retryable) instead of evicting when the buffer is full",
    )
    accepted_ids_window: int = Field(
        default=65536,
        ge=1,
        description="Accepted rollout ids remembered to acknowledge resends as duplicates",
    )
    max_tracked_senders: int = Field(default=4096, ge=1, description="Senders with their own counters")
    sender_bytes_per_second: float = Field(
        default=8 * 1024 * 1024,
        gt=0,
        description="Bytes per second one sender may push (a token bucket with a burst of "
        "``sender_burst_seconds``); a frame beyond its quota is refused from its header (rate_limited)",
    )
    sender_cpu_share: float = Field(
        default=0.5,
        gt=0,
        description="Seconds of validation per second one sender may cost (tokenizing, re-scoring); a sender "
        "in debt is refused before anything it sends is read (rate_limited)",
    )
    sender_burst_seconds: float = Field(
        default=4.0, gt=0, description="How many seconds of its quotas a sender may spend at once"
    )
    min_sender_share: int = Field(
        default=4,
        ge=1,
        description="Share of the buffer no sender is ever pushed below: when the buffer is full, a sender "
        "holding less than max(this, capacity / (active senders + 1)) gets room at the expense of a sender "
        "holding more",
    )
    active_sender_window: float = Field(
        default=60.0, gt=0, description="Seconds after its last accepted group that a sender counts as active"
    )
    drop_no_signal: bool = Field(
        default=True,
        description="Refuse valid groups whose re-scored rewards are all equal (no_signal: a group-normalised "
        "advantage of 0 teaches nothing; DAPO's dynamic sampling) before they take buffer and batch slots; "
        "they still count in received_reward_mean and against the sender's grant, never as a strike",
    )
    received_reward_window: int = Field(
        default=256,
        ge=1,
        le=1_000_000,
        description="Groups received (validated, no_signal and duplicate_content included) over which "
        "received_reward_mean is taken",
    )
    max_streams_per_sender: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Push streams one sender may hold open at once; more are closed unread (too_many_streams)",
    )
    max_streams: int = Field(
        default=256,
        ge=2,
        le=65536,
        description="Push streams open at once from all senders (each holds a file descriptor); senders none "
        "of whose groups was accepted yet share half of them, so strangers cannot crowd out proven senders",
    )


class PusherConfig(BaseModel):
    """How an inference peer pushes rollouts to trainers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    outbox_groups: int = Field(
        default=64, ge=1, description="Most unacknowledged groups held; submit blocks above"
    )
    batch_groups: int = Field(
        default=32, ge=1, description="Most groups per push (fewer round trips: the ack waits for validation)"
    )
    push_timeout: float = Field(default=15.0, gt=0, description="Deadline (s) of one push, ack included")
    retry_cooldown: float = Field(
        default=10.0, ge=0, description="Most seconds a failing trainer is not pushed to (the back-off's cap)"
    )
    full_recheck: float = Field(
        default=0.2, gt=0, description="Seconds before a trainer that answered buffer_full is probed again"
    )
    first_retry: float = Field(
        default=0.5, ge=0, description="Seconds a trainer is not pushed to after one failed push (doubles)"
    )
    refresh_period: float = Field(
        default=2.0, gt=0, description="Seconds between two reads of the trainer list"
    )
    idle_wait: float = Field(default=0.5, gt=0, description="Seconds to wait when no trainer has room")
    max_attempts: int = Field(
        default=5, ge=1, description="Sends of a group refused with internal_error before it is dropped"
    )
    max_group_bytes: int = Field(
        default=MAX_GROUP_BYTES, ge=1024, description="Largest serialized group sent"
    )


class SampleServerConfig(BaseModel):
    """Limits of an inference peer's sample RPC."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_prompts_per_request: int = Field(default=64, ge=1, description="Most prompt ids in one request")
    max_completions: int = Field(default=64, ge=1, description="Most completions per prompt (G)")
    max_new_tokens: int = Field(
        default=1024, ge=1, description="Largest max_new_tokens a request may ask for"
    )
    max_concurrent: int = Field(default=1, ge=1, description="Requests sampled at once")
    max_waiting: int = Field(
        default=8, ge=0, description="Requests queued behind those; more are refused (busy)"
    )
    version_timeout: float = Field(
        default=120.0, gt=0, description="Deadline (s) to fetch a requested version once it is announced"
    )
    version_grace: float = Field(
        default=10.0,
        gt=0,
        description="Deadline (s) for a requested version to appear among the trusted trainers' policy "
        "records; then it is refused (unknown_version). No sampling slot is held while waiting",
    )
    version_poll: float = Field(
        default=0.5,
        gt=0,
        description="Seconds between two reads of the policy records while requests wait (shared by all)",
    )
    sample_timeout: float = Field(default=600.0, gt=0, description="Deadline (s) of the sampling itself")
    max_group_bytes: int = Field(
        default=MAX_GROUP_BYTES, ge=1024, description="Largest serialized group sent"
    )


class SampleClientConfig(BaseModel):
    """How a trainer asks inference peers for rollouts in sync mode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_timeout: float = Field(default=60.0, gt=0, description="Deadline (s) of one request to one peer")
    max_prompts_per_request: int = Field(default=64, ge=1, description="Most prompt ids sent in one request")
    retry_cooldown: float = Field(
        default=30.0, ge=0, description="Seconds a failed peer is asked only as a last resort"
    )
    refresh_period: float = Field(default=2.0, gt=0, description="Seconds between two reads of the peer list")
    max_unproven_per_round: int = Field(
        default=4,
        ge=1,
        description="Peers that never delivered a group asked per round, at random, one prompt each once "
        "others have delivered (what a flood of fake sampler records can cost a round)",
    )
    unproven_dial_timeout: float = Field(
        default=5.0, gt=0, description="Deadline (s) to reach a peer that never delivered a group"
    )
    idle_wait: float = Field(default=0.5, gt=0, description="Seconds to wait when no inference peer is found")
    max_group_bytes: int = Field(
        default=MAX_GROUP_BYTES, ge=1024, description="Largest serialized group parsed"
    )
