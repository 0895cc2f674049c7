"""How far a trainer's own policy moved: the log-prob gap an honest stale group is allowed.

A sampler that sampled a group at version ``v`` reports the log-probs of version ``v``; the trainer scores
them with the weights it holds at ``w >= v``. The gap between the two is the sampler's error (rounding,
quantisation, or a lie) *plus* how far the policy itself moved from ``v`` to ``w``. Most steps move it by
hundredths of a nat per token, but an optimizer step can move it by several nats at once (Adam after a
quiet stretch, a large learning rate): judged against a fixed bound, every honest sampler's stale groups
would then look like lies and be banned together (a run that bans all its samplers stops).

So the trainer measures its own movement: after each update that makes a new version it re-scores a few
sequences of the batch it just trained on (``Learner.measure_drift``: mean |log-prob change| per token)
and records it here for the span of versions the update crossed. ``since(v, w)`` sums the spans from ``v``
to ``w`` (per token, |a - c| <= |a - b| + |b - c|, so the sum bounds the movement on the probe's tokens and
estimates it on others): the allowance added to the gap limits. A span never measured (before this
trainer joined, after a reload) is unknown: ``since`` returns None and such groups are not judged.

Owned here: ``PolicyDrift`` (bounded, thread-safe). Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class PolicyDrift:
    """Measured movement of the policy per span of versions (see the module doc)."""

    def __init__(self, max_spans: int = 256) -> None:
        self.max_spans = max_spans
        self._spans: OrderedDict[int, tuple[int, float]] = OrderedDict()  # start -> (end, drift)
        self._lock = threading.Lock()

    def record(self, start: int, end: int, drift: float | None) -> None:
        """The policy moved from version ``start`` to ``end`` by ``drift`` (None: not measured)."""
        if end <= start:
            return
        with self._lock:
            for key in [s for s, (e, _) in self._spans.items() if s < end and e > start]:
                del self._spans[key]  # a span recorded again (a reload went back) replaces what overlaps it
            if drift is None or not drift >= 0.0 or drift == float("inf"):
                return  # unknown: ``since`` cannot cross this span
            self._spans[start] = (end, float(drift))
            while len(self._spans) > self.max_spans:
                self._spans.popitem(last=False)

    def reset(self) -> None:
        """The weights were replaced (reloaded): what was measured no longer describes them."""
        with self._lock:
            self._spans.clear()

    def since(self, version: int, current: int) -> float | None:
        """How far the policy moved from ``version`` to ``current``; 0 when ``version >= current``, None
        when a span on the way was not measured."""
        if version >= current:
            return 0.0
        total, at = 0.0, version
        with self._lock:
            spans = sorted(self._spans.items())
        for start, (end, drift) in spans:
            if end <= at:
                continue
            if start > at:
                return None  # a gap in what was measured
            total += drift
            at = end
            if at >= current:
                return total
        return None
