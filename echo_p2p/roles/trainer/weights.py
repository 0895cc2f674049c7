"""The trainer's own weights: where a fresh run starts, whether they are finite, and the last good state.

Owned here: helpers of the trainer peer that touch its model and optimizer state but not the network
(kept apart from ``peer.py``, which wires the role's parts together). Callers: ``TrainerPeer``.
"""

from __future__ import annotations

import logging

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
