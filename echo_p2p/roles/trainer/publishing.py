"""When the publishing trainer sends out the version it holds.

Owned here: ``PublishSchedule`` — every version by default; sync mode publishes in line (the next batch is
asked for at this version); async mode snapshots the weights and encodes, signs and announces them in the
publisher's worker thread while training goes on, at most one publish in flight (newer versions wait and
only the newest goes out next) and no more often than ``trainer.publish_interval``. Whether this trainer
publishes at all is ``election.elect_publisher``'s; what a publish does is
``transport.weights.publisher.WeightPublisher``'s. Caller: ``TrainerPeer``. No torch, no network.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)


class PublishSchedule:
    """Which versions a publisher sends, and when (see the module doc).

    :param publisher: ``publish(tensors, version)`` and ``publish_in_background(tensors, version) -> Future``
    :param in_background: async mode (publish in the publisher's thread); sync mode publishes in line
    :param interval: the fewest seconds between two background publishes (0: every version)
    :param clock: monotonic seconds (tests pass their own)
    """

    def __init__(
        self,
        publisher: Any,
        in_background: bool,
        interval: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        prefix: Callable[[], str] = lambda: "",
    ) -> None:
        self.publisher = publisher
        self.in_background = in_background
        self.interval = interval
        self.clock = clock
        self.prefix = prefix  # the log prefix, read per line (the version in it moves)
        self.published = 0  # versions handed to the publisher
        self.seconds = 0.0  # time the training thread spent handing them over
        self._version: int | None = None  # the newest version handed over
        self._at = -float("inf")  # when it was handed over
        self._in_flight: Any = None  # the background publish not yet done, a Future

    @property
    def in_flight(self) -> Any:
        """The background publish not yet collected (a Future), or None."""
        return self._in_flight

    def maybe(self, version: int, tensors: Callable[[], Iterable]) -> bool:
        """Publish ``version`` (its weights from ``tensors()``, taken only if it goes out) unless it was
        published already, a background publish is still in flight, or the interval has not passed; True
        when it went out. Called after each version is reached and on every idle turn of the loop, so a
        version held back goes out as soon as it may."""
        if self._version == version:
            return False
        t0 = self.clock()
        if not self.in_background:
            self.publisher.publish(tensors(), version)
        else:
            if t0 - self._at < self.interval:
                return False
            if self._in_flight is not None:
                if not self._in_flight.done():
                    return False
                self._collect()
            self._in_flight = self.publisher.publish_in_background(tensors(), version)
        self.seconds += self.clock() - t0
        self._version = version
        self._at = t0
        self.published += 1
        return True

    def _collect(self) -> None:
        future, self._in_flight = self._in_flight, None
        exc = future.exception() if future is not None else None
        if exc is not None:
            logger.error("%s publishing a version failed: %r", self.prefix(), exc)
