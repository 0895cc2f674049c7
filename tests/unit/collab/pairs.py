"""Shared by the collab unit tests that run real hivemind averagers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import hivemind
import torch


@contextlib.contextmanager
def averager_pair(cls: type, prefix: str, **kwargs) -> Iterator[list]:
    """Two started ``cls`` gradient averagers over ``torch.nn.Linear(4, 2)`` on two in-process hivemind DHTs
    (127.0.0.1), their gradients 1 on the first and 2 on the second (an average of 1.5); ``kwargs`` go to
    ``cls``. Everything is shut down on exit."""
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs()
    )
    out: list = []
    try:
        for seed, dht in enumerate((first, second)):
            torch.manual_seed(seed)
            model = torch.nn.Linear(4, 2)
            for p in model.parameters():
                p.grad = torch.full_like(p, float(seed + 1))
            out.append(cls(model.parameters(), dht=dht, prefix=prefix, start=True, **kwargs))
        yield out
    finally:
        for averager in out:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
