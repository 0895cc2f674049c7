"""Networking layer: a peer's place on hivemind's DHT (the RPC transports over it are ``echo_p2p.transport``).

- ``network_config``: ``NetworkConfig``, a node's network settings; ``node``: starting and stopping a DHT node;
  ``inprocess_dht``: a DHT node in this process (no child, no torch); ``lean_hivemind``: importing hivemind's
  DHT and P2P without the torch that its package ``__init__``s import.
- ``identity``: the one RSA key that is a peer's libp2p identity and record-signing key.
- ``keys``: every DHT key echo_p2p reads or writes; ``records``: the typed records and their validators.
- ``directory``: announcing this peer and listing the others; ``run_record``: the owner's signed list of
  the run's trainers; ``trainer_writers``: who may write the trainer-only keys.
- ``reachability``: which addresses to announce; ``peer_cache``: the peers met, for the next start.

Modules here may import hivemind but never ``torch.nn``: they move bytes and typed records, and leave
every model computation to the pure-ML layer.
"""
