"""Networking transports between peers (hivemind P2P): weights, rollouts, trainer-swarm optimizer.

- ``weights`` (a sub-package: ``publisher``, ``fetcher``, ``service``, ...) and ``trust``: policy versions
  from trainers to inference peers, peer-assisted, accepted only from trusted trainers.
- ``rollout_push`` (inference side) / ``rollout_ingest`` (trainer side) for async mode, ``rollout_pull``
  (trainer side) / ``rollout_sample`` (inference side) for sync mode, ``rollout_config``: rollouts from
  inference peers to trainers.
- ``p2p_loop``: the one event loop both transports run on.
- ``collab_optimizer``: gradient aggregation across trainers with ``hivemind.Optimizer``.

Nothing is imported here: importing the package stays free of hivemind and torch.
"""
