"""The trainer role, one concept per module (nothing is imported here: import the module that owns a name).

- ``peer``: ``TrainerPeer``, the life cycle (start, the training loop, heartbeat, shutdown) and its figures.
- ``assembly``: ``build_intake``, the validator, sender guard and intake of either mode, put together once.
- ``intake``: where batches come from — ``SyncIntake`` (asks samplers) and ``AsyncIntake`` (owns the replay
  buffer, the ingest servicer, the pacer and the journal) — and the buffer's size for the senders seen.
- ``publishing``: ``PublishSchedule``, which versions the publisher sends and when.
- ``election``: ``elect_publisher``, which trainer publishes (pure).
- ``catchup``: ``CatchUp``, downloading the other trainers' state when behind, and ``orphaned_version``.
- ``weights``: the trainer's own weights — where a fresh run starts, whether they are finite, the last good
  state.

A trainer's defences (log-prob and sampling checks, bans, trust) are ``echo_p2p.guard``; its learning step is
``echo_p2p.train``; its averaging with other trainers is ``echo_p2p.collab``.
"""
