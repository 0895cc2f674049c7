"""Networking transports between peers (hivemind P2P): weights, rollouts, trainer-swarm optimizer.

- ``weights_service`` / ``weights_publisher`` / ``weights_fetcher`` / ``trust``: policy versions from
  trainers to inference peers, peer-assisted, accepted only from trusted trainers.
- ``rollouts`` (and its ``rollout_push`` / ``rollout_pull``): rollouts from inference peers to trainers.
- ``collab_optimizer``: gradient aggregation across trainers with ``hivemind.Optimizer``.

Nothing is imported here: importing the package stays free of hivemind and torch.
"""
