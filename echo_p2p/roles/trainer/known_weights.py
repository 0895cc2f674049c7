"""Which weights of a version number a trainer knows to be the ones a rollout group was sampled under.

The sender guard strikes a sampler for replayed draws that miss only under weights known to be its sampler's
(``SenderGuard.judge_samples``' ``known``): two trainers, or one trainer before and after a state download or a
restart, may hold different weights under one version number, and honest draws miss the wrong ones by 0.1-0.8 of
the probability mass (docs/security.md). A group's weights are known when

- every trainer of the gradient round that left its version held this trainer's state of it (the stepper's
  ``state_shared``), or
- this trainer published that version on the publisher stream the group names (``RolloutGroup.weights_stream``)
  and its weights have not been replaced since (a state download, a reload of the last good state);

and never when this trainer published that version on the group's stream and its weights were replaced after:
the samplers hold what it published, even where a later round shared the number (in a chaos soak a trainer that
published its own 266 and then downloaded the others' 266 banned a sampler for it).
"""

from __future__ import annotations

from collections import OrderedDict

#: versions remembered with the stream this trainer published them on (more than any kept past version)
PUBLISHER_MEMORY = 256


class KnownWeights:
    """The versions this trainer published, by stream, before and since its weights were last replaced."""

    def __init__(self, memory: int = PUBLISHER_MEMORY) -> None:
        self.memory = memory
        #: version -> the stream this trainer published it on, since its weights were last replaced
        self.published: OrderedDict[int, str] = OrderedDict()
        #: version -> stream of versions it published before its weights were replaced
        self.replaced: OrderedDict[int, str] = OrderedDict()
        self._downloads_seen = 0

    def record(self, version: int, stream: str) -> None:
        """``version`` went out on ``stream``."""
        self.published[version] = stream
        self.published.move_to_end(version)
        self._bound(self.published)

    def weights_replaced(self) -> None:
        """This trainer's weights were replaced: the versions it published are not its weights of those numbers
        any more."""
        for version, stream in self.published.items():
            self.replaced[version] = stream
            self.replaced.move_to_end(version)
        self._bound(self.replaced)
        self.published.clear()

    def downloaded_since(self, count: int) -> bool:
        """``count``: the stepper's state downloads so far; True when it changed since the last call (a download
        replaced the weights: the caller then calls ``weights_replaced``)."""
        changed, self._downloads_seen = count != self._downloads_seen, count
        return changed

    def known(self, version: int, stream: str, shared: bool) -> bool:
        """Whether a group of ``version`` sampled under ``stream`` had this trainer's kept weights of it;
        ``shared``: the round that left ``version`` shared this trainer's state of it."""
        if self.replaced.get(version) == stream:
            return False  # sampled under weights this trainer published and then replaced
        if shared:
            return True
        mine = self.published.get(version)
        return mine is not None and stream == mine

    def _bound(self, versions: OrderedDict[int, str]) -> None:
        while len(versions) > self.memory:
            versions.popitem(last=False)
