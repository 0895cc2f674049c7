"""A monitor served from inside another process (``bootstrap --monitor-port``, ``local --monitor``): it
borrows that process's DHT node and reads the run's directory with its identity.

Owned here: ``serve_embedded``, which starts the poller and the page and returns what to stop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from echo_p2p.monitor.config import MonitorConfig


def serve_embedded(
    dht: Any,
    identity: Any,
    run_id: str,
    trust: Any,
    config: MonitorConfig,
    connections: Callable[[], int] | None = None,
) -> tuple[Any, Any, str]:
    """Serve the monitor of ``run_id`` from ``dht``; returns ``(server, poller, url)``. ``connections``
    counts the node's open connections (None: not shown, e.g. a bootstrap holds the records itself).
    Raises ``OSError`` when the port is taken (nothing is left running then)."""
    from echo_p2p.monitor.poller import Poller
    from echo_p2p.monitor.server import MonitorServer
    from echo_p2p.net.directory import SwarmDirectory
    from echo_p2p.net.keys import SwarmKeys

    directory = SwarmDirectory(dht, SwarmKeys(run_id), identity, request_timeout=5.0)
    poller = Poller(directory, run_id, trust, config, connections).start()
    server = MonitorServer(poller, config)
    try:
        url = server.start()
    except (OSError, TimeoutError):
        poller.stop()
        raise
    return server, poller, url
