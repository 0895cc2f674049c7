"""Networking transports between peers (hivemind P2P): weights and rollouts.

- ``weights`` (a sub-package: ``publisher``, ``fetcher``, ``service``, ...): policy versions from trainers
  to inference peers, peer-assisted, accepted only from trusted trainers (``echo_p2p.guard.trust``).
- ``rollouts`` (a sub-package: ``push`` / ``ingest`` for async mode, ``pull`` / ``sample`` for sync mode,
  ``config``, ``refusals``): rollouts from inference peers to trainers, bounded per sender by
  ``echo_p2p.guard.quota``.
- ``streams``: server-streaming RPCs that keep their stream until the caller closes (weights and rollouts).
- ``p2p_loop``: the one event loop both transports run on.

Nothing is imported here: importing the package stays free of hivemind and torch.
"""
