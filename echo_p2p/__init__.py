"""echo_p2p: peer-to-peer RL post-training of language models (Echo, arXiv 2508.05387).

Importing the package is cheap on purpose: no torch, no hivemind. Heavy modules are imported by the
peers that need them, so `python -m echo_p2p.peer --help` stays instant.
"""

__version__ = "0.1.0"

#: Wire protocol version. It is part of every DHT key (``echo/v3/...``) and every record; peers ignore
#: records of another protocol version with one log line.
PROTOCOL_VERSION = 3
