"""The trainer peer: ingests rollouts, trains with GRPO, averages with other trainers, publishes versions.

Owned here: the trainer role's record fields and figures. Ingest, the replay buffer, GRPO and
hivemind.Optimizer are wired in by the training layer (``echo_p2p.train``); until then the trainer
announces that it accepts no rollouts (``free_buffer_room`` 0), so no inference peer pushes to it.
"""

from __future__ import annotations

from typing import Any

from echo_p2p.roles.base import BasePeer


class TrainerPeer(BasePeer):
    role = "trainer"

    def __init__(self, config, identity=None):
        super().__init__(config, identity)
        self.free_buffer_room = 0
        self.accepts_rollouts = False

    def role_fields(self) -> dict[str, Any]:
        return {"free_buffer_room": self.free_buffer_room, "accepts_rollouts": self.accepts_rollouts}

    def figures(self) -> dict[str, Any]:
        return self.role_fields()
