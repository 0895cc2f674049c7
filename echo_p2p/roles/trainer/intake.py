"""Where a trainer's batches come from, in either mode.

Owned here: ``SyncIntake`` — pick the step's prompts, ask inference peers to sample them at the trainer's
policy version (``transport.rollouts.pull.SampleClient``), validate every group as it arrives and count the
refusals — and ``AsyncIntake``, which owns the async path's parts: the replay buffer, the ingest servicer
that fills it, the pacer that says what to sample, and the journal of acknowledged groups
(``train.journal``: a group is settled once a version it was used for is reached, and a trainer restarted
with ``--resume`` puts the unsettled ones back in its buffer); ``async_buffer_capacity``, the buffer's size
for the inference peers that push to the trainer. Both answer the same calls, so the trainer peer never asks
which mode it is in: ``collect(version)`` once per step, ``used``/``discarded``/``reached`` after it,
``on_heartbeat``, ``figures`` and ``close``. Built by ``assembly.build_intake``; called by
``peer.TrainerPeer``.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from echo_p2p.train.buffer import recommended_capacity
from echo_p2p.transport.rollouts.config import PusherConfig

#: Seconds the async loop waits on the buffer before counting the time as idle and looking again.
TAKE_WAIT = 0.5

logger = logging.getLogger(__name__)


class SyncIntake:
    """Collects one on-policy batch per call (see the module doc)."""

    accepts_rollouts = False  # nothing is pushed to a sync trainer: it asks for what it trains on

    def __init__(
        self,
        client: Any,
        validator: Any,
        task: Any,
        config: Any,
        stop_event: threading.Event,
        prefix: Callable[[], str] = lambda: "",
    ) -> None:
        self.client = client  # a SampleClient
        self.validator = validator  # an IngestValidator
        self.task = task
        self.config = config  # the PeerConfig
        self.stop_event = stop_event
        self.prefix = prefix  # the log prefix, read per line (the version in it moves)
        self.rejected: Counter[str] = Counter()
        self._rng = random.Random(config.seed)

    def collect(self, version: int) -> list | None:
        """The validated groups of one step at ``version``, or None when none came (no inference peer yet,
        or all of them failed: the caller asks again)."""
        from echo_p2p.train.scored import ScoredGroup
        from echo_p2p.transport.rollouts.refusals import Rejection

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
            logger.info("%s sync collection failed: %s", self.prefix(), exc)
            self.stop_event.wait(1.0)
            return None
        if len(scored) < section.prompts_per_step:
            logger.info(
                "%s got %d/%d groups at version %d before the deadline",
                self.prefix(),
                len(scored),
                section.prompts_per_step,
                version,
            )
        return scored or None

    # sync batches are sampled on request and used at once: nothing was acknowledged, nothing to settle
    def used(self, batch: list) -> None:
        pass

    def discarded(self, batch: list) -> None:
        pass

    def reached(self, version: int) -> None:
        pass

    def recover(self, version: int) -> None:
        pass

    def free_room(self) -> int:
        return 0

    def batch_due(self) -> bool:
        return False  # a batch is asked for, never waiting

    def buffered(self) -> int | None:
        return None

    def future_refused(self) -> int:
        return 0  # a sync batch is sampled at the trainer's version: none is ahead of it

    def on_heartbeat(self) -> None:
        pass

    def figures(self) -> dict[str, Any]:
        return {"rejected": dict(self.rejected)} if self.rejected else {}

    def close(self) -> None:
        pass


def async_buffer_capacity(section: Any, senders: int) -> int:
    """The async replay buffer's size: ``trainer.buffer_capacity`` when set, else ``recommended_capacity`` for
    the inference peers pushing to this trainer. ``senders`` is how many it accepted groups from recently
    (the ingest's ``active_senders``), counted as at least 1 and at most the ingest's ``max_streams`` (no more
    pushes can be in flight at once)."""
    if section.buffer_capacity:
        return section.buffer_capacity
    return recommended_capacity(
        section.prompts_per_step,
        section.max_staleness,
        num_inference_peers=min(max(1, senders), section.ingest_server.max_streams),
        groups_per_push=PusherConfig().batch_groups,
    )


def open_journal(section: Any) -> Any:
    """The intake journal next to the checkpoints (``trainer.journal``; None without a ``checkpoint_dir``):
    to be read back by ``AsyncIntake.recover`` with ``--resume``, else started empty."""
    if not (section.checkpoint_dir and section.journal):
        return None
    from echo_p2p.train.journal import JOURNAL_NAME, IntakeJournal

    journal = IntakeJournal(os.path.join(section.checkpoint_dir, JOURNAL_NAME))
    return journal if section.resume else journal.open()


class AsyncIntake:
    """Async mode: one batch per call from the replay buffer, and the parts that fill it (see the module doc).

    :param buffer: the ``ReplayBuffer`` the ingest servicer adds to (with ``journal`` as its journal, if any)
    :param section: the trainer's config section (``prompts_per_step``, ``max_staleness``)
    :param journal: an ``IntakeJournal`` or None
    :param ingest: the ``RolloutIngestServicer`` that adds pushed groups to ``buffer`` (None: groups are added
        by the caller, as in tests); ``on_heartbeat`` sizes the buffer for its active senders, ``close`` stops it
    :param pacer: the ``Pacer`` the ingest grants with, or None (pacing off)
    """

    accepts_rollouts = True

    def __init__(
        self,
        buffer: Any,
        section: Any,
        journal: Any = None,
        prefix: Callable[[], str] = lambda: "",
        ingest: Any = None,
        pacer: Any = None,
    ) -> None:
        self.buffer = buffer
        self.section = section
        self.journal = journal
        self.prefix = prefix  # the log prefix, read per line (the version in it moves)
        self.ingest = ingest
        self.pacer = pacer
        self.recovered = 0  # groups read back from the journal and buffered again
        self.recovered_stale = 0  # groups read back from the journal, too stale by then
        self._pending: list = []  # taken from the buffer, not yet a whole batch
        self._used: list[str] = []  # ids trained on since the last version reached

    def collect(self, version: int) -> list | None:
        """A whole batch of usable groups at ``version``, or None (what was taken waits for the next call)."""
        pending, stale = [], []
        for g in self._pending:
            (pending if version - g.policy_version <= self.section.max_staleness else stale).append(g)
        if stale:
            self._settle(g.rollout_id for g in stale)
        need = self.section.prompts_per_step - len(pending)
        if need > 0:
            pending += self.buffer.take(need, version, timeout=TAKE_WAIT)
        if len(pending) < self.section.prompts_per_step:
            self._pending = pending
            return None
        self._pending = []
        return pending

    def used(self, batch: list) -> None:
        """``batch`` went into a step: settled when the next version is reached (``reached``)."""
        self._used.extend(g.rollout_id for g in batch)

    def discarded(self, batch: list) -> None:
        """``batch`` was thrown away (not finite): settled now."""
        self._settle(g.rollout_id for g in batch)

    def reached(self, version: int) -> None:
        """The weights moved to ``version``: what was trained on before is in it; drop what is too stale."""
        self._settle(self._used)
        self._used = []
        self.buffer.drop_stale(version)

    def recover(self, version: int) -> None:
        """Put the journal's unsettled groups (a previous run's, acknowledged and unused) back in the buffer."""
        if self.journal is None:
            return
        from echo_p2p.train.buffer import AddResult

        groups = self.journal.recover()  # still on disk until settled, whatever happens next
        if len(groups) > self.buffer.capacity:  # sized before any sender is seen: room for every one
            self.buffer.resize(len(groups))
        self.buffer.journal = None  # they are in the journal already
        try:
            results = [(g.rollout_id, self.buffer.add(g, version)) for g in groups]
        finally:
            self.buffer.journal = self.journal
        self.recovered = sum(r is AddResult.ADDED for _, r in results)
        self.recovered_stale = sum(r is AddResult.STALE for _, r in results)
        self._settle(rid for rid, r in results if r is not AddResult.ADDED)
        if self.recovered or self.recovered_stale:
            logger.info(
                "%s recovered %d acknowledged groups from its intake journal (%d more were too stale at "
                "version %d)",
                self.prefix(),
                self.recovered,
                self.recovered_stale,
                version,
            )

    def free_room(self) -> int:
        return self.buffer.free_room()

    def batch_due(self) -> bool:
        """A whole batch is buffered: the loop must come round to take it (the watchdog's due predicate)."""
        return self.buffer.peek_size() >= self.section.prompts_per_step

    def buffered(self) -> int | None:
        return len(self.buffer)

    def future_refused(self) -> int:
        """Pushes refused so far as ``future_version`` (sampled at a version this trainer has not reached)."""
        return self.ingest.totals.rejected["future_version"] if self.ingest is not None else 0

    def on_heartbeat(self) -> None:
        """Room in the buffer for the pushes of the senders the ingest sees now (``async_buffer_capacity``)."""
        if self.ingest is not None:
            self.buffer.resize(async_buffer_capacity(self.section, self.ingest.active_senders()))

    def figures(self) -> dict[str, Any]:
        stats = self.buffer.stats().as_dict()
        out: dict[str, Any] = {
            "buffer": {k: stats[k] for k in ("size", "free_room", "dropped_stale", "evicted", "duplicates")},
            "dropped_stale": stats["dropped_stale"],
        }
        if self.pacer is not None:
            out["pacing"] = self.pacer.stats()
        if self.ingest is not None:
            ingest = self.ingest.stats()
            out["rejected"] = dict(ingest.get("rejected", {}))
            # the reward of what samplers send, useless groups included (reward_mean is that of what is
            # trained on, biased low once the policy is mostly right: its all-right groups are dropped)
            out["received_reward_mean"] = ingest.get("received_reward_mean")
        if self.journal is not None:
            out["journal"] = self.journal.snapshot()
            out["journal_recovered"] = self.recovered
            out["journal_recovered_stale"] = self.recovered_stale
        return out

    def close(self) -> None:
        """Stop taking pushes, then close the journal (what was acknowledged is on disk)."""
        try:
            if self.ingest is not None:
                self.ingest.shutdown()
        finally:
            if self.journal is not None:
                self.journal.close()

    def _settle(self, ids) -> None:
        if self.journal is not None:
            self.journal.settled(ids)
