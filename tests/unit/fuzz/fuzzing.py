"""Shared pieces of the fuzz tests (not a pytest module): hypothesis settings that make every run the same
(``derandomize``, no example database) and short, strategies for what a hostile peer can send (any
msgpack value, honest records with one field broken, truncated bytes), a fake RPC context, and a bounded
way to run a handler's coroutine and to measure the memory it allocates."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import msgpack
from hivemind.p2p import P2PContext, PeerID
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

T = TypeVar("T")

#: Every fuzz test: the same examples on every run (derandomize, no database), a per-example deadline far
#: above what a correct handler needs (it catches hangs, never slowness), and few examples: the whole fuzz
#: suite stays around 30 s on 2 cores.
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=10),
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

#: A deadline for one handler call: nothing a peer sends may make a handler take longer.
HANDLER_DEADLINE = 10.0

ALICE = PeerID(b"\x12\x20" + b"\x01" * 32)
ME = PeerID(b"\x12\x20" + b"\x02" * 32)


def context(peer: PeerID = ALICE) -> P2PContext:
    return P2PContext(handle_name="fuzz", local_id=ME, remote_id=peer)


def run(loop: asyncio.AbstractEventLoop, coro, timeout: float = HANDLER_DEADLINE):
    """Run a handler's coroutine on ``loop`` with a deadline (a hang fails the test, it never blocks it)."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


def peak_allocated(fn: Callable[[], T]) -> tuple[T, int]:
    """``fn()`` and the peak bytes Python allocated while it ran (tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return result, peak


# ---- strategies ---------------------------------------------------------------------------------------------
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)

#: Any value msgpack can carry (what a peer can put in a record or a group), nested a few levels.
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=12) | st.integers(-(2**63), 2**63 - 1), inner, max_size=6)
    ),
    max_leaves=20,
)


def packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@st.composite
def broken(draw, honest: dict[str, Any]) -> dict[str, Any]:
    """``honest`` with some fields replaced by any value, removed, or unknown ones added (nested paths too)."""
    record = dict(honest)
    for _ in range(draw(st.integers(1, 3))):
        keys = sorted(record, key=str)
        action = draw(st.sampled_from(["replace", "remove", "add", "nested"]))
        if action == "add" or not keys:
            record[draw(st.text(max_size=12))] = draw(values)
            continue
        key = draw(st.sampled_from(keys))
        if action == "remove":
            del record[key]
        elif action == "replace":
            record[key] = draw(values)
        elif isinstance(record[key], list) and record[key]:
            items = list(record[key])
            i = draw(st.integers(0, len(items) - 1))
            item = items[i]
            if isinstance(item, dict) and item:
                items[i] = draw(broken(item))
            else:
                items[i] = draw(values)
            record[key] = items
        else:
            record[key] = draw(values)
    return record


@st.composite
def hostile_bytes(draw, honest: bytes, extra: Any = None) -> bytes:
    """Bytes a peer may send instead of ``honest``: random, truncated, bit-flipped, any msgpack value, or
    (with ``extra``, a strategy) something else of the caller's choice."""
    options = ["random", "truncated", "flipped", "value"] + (["extra"] if extra is not None else [])
    kind = draw(st.sampled_from(options))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "truncated":
        return honest[: draw(st.integers(0, max(0, len(honest) - 1)))]
    if kind == "flipped":
        data = bytearray(honest)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if kind == "value":
        return packed(draw(values))
    return draw(extra)


#: msgpack headers that declare far more data than follows (a str, bin, array, map of 2^32 - 1).
HUGE_HEADERS = [
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
]
