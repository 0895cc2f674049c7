"""``MonitorConfig``: where the monitor listens, how often it reads the DHT, and when an alert fires.

Callers: the monitor CLI, ``echo_p2p.local --monitor``, ``echo_p2p.bootstrap --monitor-port``, and
``swarm status`` (for the thresholds of its alerts). Cheap to import: pydantic only.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Default port of ``python -m echo_p2p.monitor`` (the local run and the bootstrap take a free one).
DEFAULT_PORT = 8470


class MonitorConfig(BaseModel):
    """A monitor's settings; every field has a default that suits a small run."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    host: str = Field(
        default="127.0.0.1",
        max_length=255,
        description="Address to listen on; 127.0.0.1 keeps the page on this machine",
    )
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="TCP port (0: any free port)")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Host names (besides localhost and IP addresses) the page may be reached by, e.g. behind "
        "a reverse proxy; requests naming any other host are refused (DNS rebinding)",
    )
    poll_period: float = Field(default=2.0, ge=0.2, le=600, description="Seconds between two DHT reads")
    stall_after: float = Field(
        default=120.0, gt=0, description="Alert version_stalled: no new policy version for this many seconds"
    )
    buffer_empty_after: float = Field(
        default=60.0,
        gt=0,
        description="Alert buffer_empty: a trainer's buffer empty and nothing consumed for this many seconds",
    )
    default_max_staleness: int = Field(
        default=4,
        ge=0,
        le=1024,
        description="Alert peer_lagging: versions an inference peer may lag when no trainer announces its bound",
    )
    history_size: int = Field(default=3600, ge=10, le=100_000, description="Samples of history kept")
    max_peers: int = Field(
        default=500, ge=1, le=10_000, description="Peers listed at most (the rest counted)"
    )
