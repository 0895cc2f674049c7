"""Sync mode's intake: one batch of rollout groups sampled on request at the trainer's version.

Owned here: ``SyncIntake`` — pick the step's prompts, ask inference peers to sample them at the trainer's
policy version (``transport.rollout_pull.SampleClient``), validate every group as it arrives and count the
refusals. Called by ``roles.trainer`` in sync mode (async mode takes its batches from the replay buffer).
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)


class SyncIntake:
    """Collects one on-policy batch per call (see the module doc)."""

    def __init__(
        self,
        client: Any,
        validator: Any,
        task: Any,
        config: Any,
        stop_event: threading.Event,
        prefix: str = "",
    ) -> None:
        self.client = client  # a SampleClient
        self.validator = validator  # an IngestValidator
        self.task = task
        self.config = config  # the PeerConfig
        self.stop_event = stop_event
        self.prefix = prefix
        self.rejected: Counter[str] = Counter()
        self._rng = random.Random(config.trainer.seed)

    def collect(self, version: int) -> list | None:
        """The validated groups of one step at ``version``, or None when none came (no inference peer yet,
        or all of them failed: the caller asks again)."""
        from echo_p2p.train.buffer import ScoredGroup
        from echo_p2p.train.ingest import Rejection

        section = self.config.trainer
        scored: list[ScoredGroup] = []

        def accept(group) -> bool:
            result = self.validator.validate(group, version)
            if isinstance(result, Rejection):
                self.rejected[result.reason] += 1
                return False
            scored.append(result)
            return True

        self.client.accept = accept
        prompt_ids = self.task.sample_prompt_ids(self._rng, section.prompts_per_step)
        try:
            self.client.collect(
                self.task.name,
                prompt_ids,
                self.config.run.group_size,
                version,
                timeout=section.sync_timeout,
                max_new_tokens=self.config.run.max_new_tokens or 0,
            )
        except Exception as exc:  # no inference peer yet, all of them failed: wait and ask again
            logger.info("%s sync collection failed: %s", self.prefix, exc)
            self.stop_event.wait(1.0)
            return None
        if len(scored) < section.prompts_per_step:
            logger.info(
                "%s got %d/%d groups at version %d before the deadline",
                self.prefix,
                len(scored),
                section.prompts_per_step,
                version,
            )
        return scored or None
