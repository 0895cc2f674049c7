"""Peer roles: a small class per role (``run()``, ``shutdown()``) that wires the pure-ML layer to the network.

- ``base``: what every peer does whatever its role (join, heartbeat, metrics, leave).
- ``inference``: the inference peer (holds a version, samples, scores, sends rollouts).
- ``trainer``: the trainer peer, with ``trainer_intake`` (where its batches come from, in either mode, and
  its replay buffer's size), ``trainer_catchup`` (downloading the other trainers' state) and
  ``trainer_weights`` (its own weights' start, checks and recovery; the publisher election).
- ``watchdog``: progress signals with deadlines and a stall report.

A trainer's defences (log-prob checks, bans, trust) are ``echo_p2p.guard``.
"""
