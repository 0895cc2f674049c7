"""The training swarm's collaborative optimizer (like hivemind's ``optim/``): how trainers average gradients
and keep one state.

- ``optimizer``: ``CollabOptimizerConfig``, ``make_collab_optimizer`` (a ``hivemind.Optimizer`` over AdamW
  whose epoch is the policy version), ``CollabTrainerStep`` (gradients, then a swarm step),
  ``link_timeouts`` (deadlines for a link speed) and ``shutdown_optimizer``.
- ``sync``: ``SyncedOptimizer``, the lineage check on every gradient round that keeps the trainers' parameters
  and Adam statistics identical (a trainer off the round's reference downloads the whole state).
- ``progress``: ``PacedProgressTracker``, hivemind's progress record, stored at every step only while other
  trainers need it (a lone trainer: once per ``lone_progress_interval``).

Used by the trainer peer (``roles/trainer/peer.py``); the settings live in ``echo_p2p.config``. Losses are
computed in ``echo_p2p.train``, weights published by ``echo_p2p.transport.weights``. Nothing is imported
here: importing the package stays free of hivemind and torch.
"""
