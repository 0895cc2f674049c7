"""The inference peer: holds a policy version, samples and scores rollouts, sends them to trainers.

Owned here: the inference role's record fields and figures. Its engine, weight fetching and rollout
streaming are wired in by the weights and inference layers (``echo_p2p.weights``, ``echo_p2p.ml``);
until a policy version is fetched, ``policy_version`` stays None and the peer announces no throughput.
"""

from __future__ import annotations

from typing import Any

from echo_p2p.roles.base import BasePeer


class InferencePeer(BasePeer):
    role = "inference"

    def __init__(self, config, identity=None):
        super().__init__(config, identity)
        self.tokens_per_second: float | None = None
        self.rollouts_per_second: float | None = None

    def role_fields(self) -> dict[str, Any]:
        return {"tokens_per_second": self.tokens_per_second, "rollouts_per_second": self.rollouts_per_second}

    def figures(self) -> dict[str, Any]:
        return self.role_fields()
