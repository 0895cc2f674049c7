"""Peer roles: a small class per role (``run()``, ``shutdown()``) that wires the pure-ML layer to the network.

- ``base``: what every peer does whatever its role (join, heartbeat, metrics, leave).
- ``inference``: the inference peer (holds a version, samples, scores, sends rollouts).
- ``trainer``: the trainer peer, a package: ``trainer.peer`` (life cycle and loop), ``trainer.assembly`` and
  ``trainer.intake`` (where its batches come from, in either mode), ``trainer.publishing`` and
  ``trainer.election`` (which versions go out, and who sends them), ``trainer.catchup``, ``trainer.weights``.
- ``watchdog``: progress signals with deadlines and a stall report.

A trainer's defences (log-prob checks, bans, trust) are ``echo_p2p.guard``.
"""
