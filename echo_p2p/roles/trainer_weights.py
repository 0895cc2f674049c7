"""The trainer's own weights: where a fresh run starts, whether they are finite, the last good state, and
whether this trainer is the one that publishes them.

Owned here: helpers of the trainer peer that touch its model and optimizer state but not the network
(kept apart from ``trainer.py``, which wires the roles' parts together). Callers: ``TrainerPeer``.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def start_on_serving_grid(model, encoding, prefix: str = "") -> int:
    """A fresh run whose receivers hold 16-bit weights starts from weights on that grid (see
    ``EncodingConfig.start_on_serving_grid``); returns how many values moved."""
    if encoding.receiver_dtype is None or not encoding.start_on_serving_grid:
        return 0
    from echo_p2p.weights.quant import round_to_serving_grid_

    moved = round_to_serving_grid_(model.parameters(), encoding.receiver_dtype)
    logger.info(
        "%s rounded %d initial values to the %s grid receivers hold", prefix, moved, encoding.receiver_dtype
    )
    return moved


def params_finite(model) -> bool:
    import torch

    with torch.no_grad():
        return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def reload_last_good(model, optimizer, checkpoints) -> str | None:
    """After weights went NaN/inf (no gradient of ours can do that: ``Learner`` drops non-finite ones; an
    averaging round can): load the newest checkpoint, else the other trainers' state. Returns where the
    state came from, or None when neither gave finite weights."""
    if checkpoints is not None and checkpoints.latest() is not None:
        loaded = checkpoints.load()
        model.load_state_dict(loaded.model_state)
        if loaded.optimizer_state is not None:
            optimizer.load_state_dict(loaded.optimizer_state)
        source = f"checkpoint version {loaded.version}"
    else:
        try:
            optimizer.load_state_from_peers()
        except Exception as exc:
            logger.error("loading state from other trainers failed: %r", exc)
        source = "other trainers"
    return source if params_finite(model) else None


def peak_rss_mib() -> float | None:
    """This process's peak resident memory so far (MiB), or None where ``resource`` is missing."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes on macOS, KiB elsewhere


#: Versions a trainer's announced version may trail the newest one and still be elected publisher: trainers
#: that average together are one epoch apart, but their records are up to a heartbeat old each, and a fast
#: run (the tiny model: ~3 versions/s) moves several versions per heartbeat.
PUBLISHER_SLACK = 10


def elect_publisher(peer_id: str, records, trust, version: int | None = None) -> bool:
    """Whether ``peer_id`` (holding ``version``) publishes: among the running trusted trainers whose records
    are not behind the newest one (by more than ``PUBLISHER_SLACK`` versions), the one with the smallest peer
    id does, the same choice on every trainer.

    Trusted: listed by the run record or the trusted-trainers file (``trust``; None: everyone); a record
    that only says ``role: trainer`` takes no part, so an impostor (or a ghost record it left) cannot
    silence the run's publisher. A trainer that is not trusted itself never publishes. Not behind: a
    trainer that joins a running run (or fell behind) leaves publishing to one that holds the newest
    version until it has caught up, so no older version is announced in between.
    """
    if trust is not None and not trust.is_trusted(peer_id):
        return False
    held = {
        r.peer_id: r.policy_version or 0
        for r in records
        if r.role == "trainer" and r.state == "running" and (trust is None or trust.is_trusted(r.peer_id))
    }
    if peer_id not in held:  # not announced yet: what we hold. Otherwise every trainer compares the same
        held[peer_id] = version or 0  # records (a heartbeat old), so they all make the same choice
    newest = max(held.values())
    # version 0 is the initial weights: a trainer still there while another moved on (one that just joined
    # a young run, within the slack) has none of the run's updates; elected, it published its initial
    # weights and the trainer that held the run stood by until it caught up (a gap in the run's versions)
    eligible = [p for p, v in held.items() if v >= newest - PUBLISHER_SLACK and (v > 0 or newest == 0)]
    return peer_id in eligible and min(eligible) == peer_id


def orphaned_version(peer_id: str, version: int, records, policies, trust) -> int | None:
    """The version a trainer behind the run should hold from now on when nobody can give it the run's state,
    else None.

    Behind: a trusted trainer published a version above ``version`` (``policies``: ``PolicyRecord``s; inference
    peers sample with it, and this trainer refuses their rollouts as ``future_version``). Nobody can give it
    the state: no running trusted trainer other than ``peer_id`` announces (``records``) a version above
    ``version``, and the publisher of the newest version has no running record any more — the one ahead
    left (SIGKILLed while this one was behind; its record expired). Then the trainer goes on from its
    own weights as the version *after* the newest published one: a number never published with other
    weights, which inference peers take as newer, and their rollouts of the old version stay usable."""
    trusted = lambda p: trust is None or trust.is_trusted(p)  # noqa: E731
    newest = max((r for r in policies if trusted(r.peer_id)), key=lambda r: r.version, default=None)
    if newest is None or newest.version <= version:
        return None
    for r in records:
        if r.role == "trainer" and r.state == "running" and r.peer_id != peer_id and trusted(r.peer_id):
            if r.peer_id == newest.peer_id or (r.policy_version or 0) > version:
                return None  # it is alive (its record may only be a heartbeat old): catching up will do
    return newest.version + 1
