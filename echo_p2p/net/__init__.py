"""Networking layer: DHT keys and records, identities, the swarm directory and RPC transports.

Modules here may import hivemind but never ``torch.nn``: they move bytes and typed records, and leave
every model computation to the pure-ML layer.
"""
