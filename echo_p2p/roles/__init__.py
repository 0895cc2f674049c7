"""Peer roles: a small class per role (``run()``, ``shutdown()``) that wires the pure-ML layer to the network."""
