"""Putting a trainer's intake together: what checks a group, where batches come from, who is judged.

Owned here: ``build_intake`` — the rollout validator (``guard.rollout_checks``), the sender guard
(``guard.sender_guard``: log-prob checks, strikes, bans) and, by mode, a ``SyncIntake`` with its sample client
or an ``AsyncIntake`` with its replay buffer, ingest servicer (served on the trainer's P2P loop), pacer and
journal. The order matters and is kept here: unsettled groups from the journal are back in the buffer before
the ingest serves its first push. Caller: ``peer.TrainerPeer.on_start``, once. Builds; trains nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
from echo_p2p.guard.sender_guard import SenderGuard
from echo_p2p.roles.trainer.intake import (
    AsyncIntake,
    SyncIntake,
    async_buffer_capacity,
    open_journal,
)
from echo_p2p.transport.rollouts.config import rollout_namespace


@dataclasses.dataclass
class IntakeParts:
    """What ``build_intake`` gives the trainer: its intake (either mode) and the guard that judges senders."""

    intake: SyncIntake | AsyncIntake
    guard: SenderGuard


def build_intake(
    config: Any,
    task: Any,
    tokenizer: Any,
    *,
    peer_id: str,
    version: Callable[[], int],
    loop: Any,
    directory: Any,
    keys: Any,
    trust: Any,
    stop_event: threading.Event,
    prefix: Callable[[], str] = lambda: "",
) -> IntakeParts:
    """The intake of a trainer peer with ``config`` (a ``PeerConfig``) training ``task``.

    :param version: the policy version the trainer holds now (groups are validated against it)
    :param loop: the trainer's ``P2PLoop`` (async: the ingest servicer is added to it; sync: the sample
        client dials through it)
    :param directory: the swarm directory (sync: the sample client finds inference peers in it)
    :param keys: the run's DHT keys (the rollout RPCs' namespace)
    :param trust: the run's ``RunTrust`` (whose bans count)
    """
    run, section = config.run, config.trainer
    validator = IngestValidator(
        {task.name: task},
        tokenizer,
        IngestConfig(
            vocab_size=len(tokenizer),
            group_size=run.group_size,
            max_prompt_tokens=section.max_prompt_tokens,
            max_completion_tokens=run.max_new_tokens,
            max_staleness=section.max_staleness if config.mode == "async" else 0,
            reward_tolerance=section.reward_tolerance,
            use_chat_template=run.model.use_chat_template,
            sampling=run.sampling(),
            precisions=run.sampler_precisions,
            require_seed=run.seeded_sampling,
        ),
    )
    namespace = rollout_namespace(keys)
    if config.mode != "async":
        from echo_p2p.transport.rollouts.pull import SampleClient

        guard = SenderGuard(section.reputation, peer_id, None, trust, section.sampling_check)
        client = SampleClient(
            loop, directory, section.sample_client, namespace, is_banned=guard.is_banned, stop=stop_event
        )
        return IntakeParts(SyncIntake(client, validator, task, config, stop_event, prefix), guard)

    from echo_p2p.rollout import RolloutGroup
    from echo_p2p.train.buffer import ReplayBuffer
    from echo_p2p.train.pacing import Pacer
    from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer

    # sized for one sender until the ingest sees more (``AsyncIntake.on_heartbeat`` resizes it)
    buffer = ReplayBuffer(
        async_buffer_capacity(section, senders=0), section.max_staleness, order=section.buffer_order
    )
    # a group within this trainer's shape limits takes at most this many bytes: bigger ones are refused
    # from their frame header, never parsed (3.1 M token ids fitted the fixed 3 MiB cap)
    shape_bound = RolloutGroup.max_wire_bytes(
        section.max_prompt_tokens, run.group_size, run.max_new_tokens or task.max_new_tokens
    )
    ingest_config = section.ingest_server.model_copy(
        update={"max_group_bytes": min(section.ingest_server.max_group_bytes, shape_bound)}
    )
    guard = SenderGuard(section.reputation, peer_id, buffer, trust, section.sampling_check)
    pacer = (
        Pacer(section.pacing, section.prompts_per_step, section.max_staleness)
        if section.pacing.enabled
        else None
    )
    ingest = RolloutIngestServicer(
        lambda group: validator.validate(group, version()),
        buffer,
        ingest_config,
        current_version=version,
        is_banned=guard.is_banned,
        pacer=pacer,
    )
    intake = AsyncIntake(buffer, section, open_journal(section), prefix, ingest=ingest, pacer=pacer)
    intake.recover(version())  # what a previous run acknowledged goes back in before any new push
    loop.add_servicer(ingest, namespace)
    return IntakeParts(intake, guard)
