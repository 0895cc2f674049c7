"""What a trainer trains on: a rollout group it validated, with the rewards it re-computed itself.

Owned here: ``ScoredGroup`` (a validated ``RolloutGroup`` plus one trusted reward per completion, computed
with the task's verifier). Made by rollout validation and the co-located loop; held by the replay buffer and
the intake journal; read by batching and the learner. Pure Python: no torch, no hivemind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from echo_p2p.rollout import RolloutGroup


@dataclass(frozen=True)
class ScoredGroup:
    """A rollout group with the trusted rewards (one per completion) the trainer computed itself.

    ``group.completions[i].claimed_reward`` is never used by training; ``rewards[i]`` is.
    """

    group: RolloutGroup
    rewards: tuple[float, ...]

    def __init__(self, group: RolloutGroup, rewards: Sequence[float]) -> None:
        rewards = tuple(float(r) for r in rewards)
        if len(rewards) != len(group.completions):
            raise ValueError(f"{len(rewards)} rewards for {len(group.completions)} completions")
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError("rewards must be finite")
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "rewards", rewards)

    @property
    def rollout_id(self) -> str:
        return self.group.rollout_id

    @property
    def policy_version(self) -> int:
        return self.group.policy_version
