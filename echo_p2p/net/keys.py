"""Every DHT key that echo_p2p reads or writes is built here, and only here.

Keys carry the protocol version and the run id (``echo/v3/<run_id>/<name>``, bucketed keys below it), so two runs, or two
protocol versions, never read each other's records. Callers: the swarm directory, the weights and
rollout transports, the CLIs. This module must not touch the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.buckets import ALLOWED_BUCKETS, VERSION_SLOTS

# no "." : hivemind's averagers (the trainers' hivemind.Optimizer) refuse names that contain one
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
KEY_PREFIX = "echo"


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a valid run id (1-64 chars of ``A-Za-z0-9._-``), else raise ValueError."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise ValueError(
            f"invalid run id {run_id!r}: use 1-64 characters from A-Z a-z 0-9 _ - (starting with a letter or digit)"
        )
    return run_id


@dataclass(frozen=True)
class SwarmKeys:
    """The DHT keys of one run at one protocol version."""

    run_id: str
    protocol: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)

    @property
    def prefix(self) -> str:
        return f"{KEY_PREFIX}/v{self.protocol}/{self.run_id}"

    def peers(self, buckets: int, bucket: int) -> str:
        """Dictionary key of one bucket of ``buckets`` (``net.buckets``): one subkey per peer (its owner key),
        value = that peer's ``PeerRecord`` (inference peers and bootstraps; trainers announce under ``trainers``)."""
        return f"{self.prefix}/peers/{buckets}/{bucket}"

    @property
    def trainers(self) -> str:
        """Dictionary key: one subkey per trainer, value = its ``PeerRecord``. Only the trainers the run trusts
        may write it (``net.trainer_writers``): a flood of peer records cannot reach its readers."""
        return f"{self.prefix}/trainers"

    @property
    def policy(self) -> str:
        """Dictionary key: one subkey per trainer publisher, value = its newest policy manifest pointer."""
        return f"{self.prefix}/policy"

    def providers(self, buckets: int, bucket: int, version: int) -> str:
        """Dictionary key of one (version slot, bucket): one subkey per peer, value = the policy versions it
        holds completely and serves (``ProviderRecord``), stored under the slot of each version it offers."""
        return f"{self.prefix}/providers/{buckets}/{bucket}/{version % VERSION_SLOTS}"

    @property
    def run(self) -> str:
        """Dictionary key: one subkey per peer that re-stores it, value = the owner's signed run record."""
        return f"{self.prefix}/run"

    @property
    def bans(self) -> str:
        """Dictionary key: one subkey per trainer, value = the senders it banned (``BanRecord``)."""
        return f"{self.prefix}/bans"

    def all_keys(self) -> dict[str, str]:
        """Name -> raw key, for every unbucketed key of the run (used to build the DHT validators)."""
        return {
            "trainers": self.trainers,
            "policy": self.policy,
            "run": self.run,
            "bans": self.bans,
        }

    def bucket_keys(self) -> dict[str, str]:
        """Raw key -> ``"peers"`` or ``"providers"``, for every bucket key of the run at every allowed K (what a
        DHT node checks: it cannot tell which K a run uses)."""
        out = {}
        for k in ALLOWED_BUCKETS:
            for b in range(k):
                out[self.peers(k, b)] = "peers"
                out.update({self.providers(k, b, slot): "providers" for slot in range(VERSION_SLOTS)})
        return out
