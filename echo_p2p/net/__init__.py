"""Networking layer: DHT keys and records, identities, the swarm directory, the run record and starting a
DHT node (the RPC transports over it live in ``echo_p2p.transport``).

Modules here may import hivemind but never ``torch.nn``: they move bytes and typed records, and leave
every model computation to the pure-ML layer.
"""
