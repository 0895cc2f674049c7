"""buffer.py: staleness policy, eviction order, de-duplication, reuse, free room and thread safety."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from echo_p2p.train.buffer import AddResult, ReplayBuffer, recommended_capacity


@pytest.fixture
def g(scored_group):
    def make(version: int, rid: str | None = None):
        return scored_group([5], [[6], [7]], [0.0, 1.0], version=version, rollout_id=rid)

    return make


def _ids(groups) -> list[str]:
    return [x.rollout_id for x in groups]


def test_take_drops_stale_and_hands_out_oldest_first(g) -> None:
    buf = ReplayBuffer(capacity=10, max_staleness=2)
    for v, rid in [(5, "a"), (3, "b"), (7, "c"), (4, "d"), (5, "e"), (6, "f")]:
        assert buf.add(g(v, rid)) is AddResult.ADDED
    assert buf.stats().per_version == {3: 1, 4: 1, 5: 2, 6: 1, 7: 1}
    assert buf.num_usable(7) == 4
    out = buf.take(3, current_version=7)  # 3 and 4 are > 2 versions stale
    assert _ids(out) == ["a", "e", "f"]
    st = buf.stats()
    assert st.dropped_stale == 2 and st.taken == 3 and st.size == 1
    assert st.taken_staleness == {1: 1, 2: 2}
    assert _ids(buf.take(5, current_version=7)) == ["c"]
    assert buf.take(5, current_version=7) == []


def test_sync_mode_takes_only_current_version(g) -> None:
    buf = ReplayBuffer(capacity=4, max_staleness=0)
    buf.add(g(0, "old"))
    buf.add(g(1, "new"))
    assert _ids(buf.take(2, current_version=1)) == ["new"]
    assert buf.stats().dropped_stale == 1


def test_add_refuses_group_already_stale(g) -> None:
    buf = ReplayBuffer(capacity=4, max_staleness=1)
    assert buf.add(g(3, "x"), current_version=5) is AddResult.STALE
    assert not buf.add(g(3, "y"), current_version=5)
    assert buf.add(g(4, "z"), current_version=5)
    assert buf.stats().dropped_stale == 2 and len(buf) == 1


def test_full_buffer_evicts_oldest(g) -> None:
    buf = ReplayBuffer(capacity=3, max_staleness=10)
    for v, rid in [(2, "a"), (1, "b"), (2, "c")]:
        buf.add(g(v, rid))
    assert buf.free_room() == 0
    assert buf.add(g(3, "d")) is AddResult.ADDED  # evicts b (version 1)
    assert buf.add(g(0, "e")) is AddResult.EVICTED  # older than everything: it is the one evicted
    assert buf.add(g(2, "f")) is AddResult.ADDED  # evicts a (version 2, arrived first)
    assert _ids(buf.take(10, current_version=3)) == ["c", "f", "d"]
    st = buf.stats()
    assert st.evicted == 3 and st.added == 5


def test_duplicates_are_refused_within_the_window(g) -> None:
    buf = ReplayBuffer(capacity=10, max_staleness=5, seen_ids_window=3)
    assert buf.add(g(0, "a"))
    assert buf.add(g(0, "a")) is AddResult.DUPLICATE
    buf.take(1, current_version=0)
    assert buf.add(g(0, "a")) is AddResult.DUPLICATE  # already used: still a duplicate
    for rid in ("b", "c", "d"):
        buf.add(g(0, rid))
    assert buf.add(g(0, "a")) is AddResult.ADDED  # fell out of the 3-id window
    assert buf.stats().duplicates == 2


def test_each_group_used_once_by_default_and_reuse_counts(g) -> None:
    buf = ReplayBuffer(capacity=10, max_staleness=5)
    buf.add(g(0, "a"))
    buf.add(g(0, "b"))
    assert _ids(buf.take(5, 0)) == ["a", "b"]
    assert buf.take(5, 0) == []

    buf = ReplayBuffer(capacity=10, max_staleness=5, reuse=2)
    buf.add(g(0, "a"))
    buf.add(g(0, "b"))
    first = _ids(buf.take(1, 0))
    assert first == ["a"]
    assert _ids(buf.take(5, 0)) == ["b", "a"]  # never twice in one batch; a goes behind b
    assert _ids(buf.take(5, 0)) == ["b"]
    assert buf.take(5, 0) == []
    assert buf.stats().taken == 4


def test_free_room_and_drop_stale(g) -> None:
    buf = ReplayBuffer(capacity=5, max_staleness=1)
    assert buf.free_room() == 5
    for i in range(4):
        buf.add(g(i, str(i)))
    assert buf.free_room() == 1
    assert buf.drop_stale(current_version=3) == 2
    assert buf.free_room() == 3
    assert buf.stats().as_dict()["free_room"] == 3


def test_take_with_timeout_waits_for_a_full_batch(g) -> None:
    buf = ReplayBuffer(capacity=10, max_staleness=0)
    buf.add(g(1, "a"))

    def feed() -> None:
        time.sleep(0.05)
        buf.add(g(1, "b"))

    threading.Thread(target=feed).start()
    t0 = time.monotonic()
    assert len(buf.take(2, current_version=1, timeout=5.0)) == 2
    assert time.monotonic() - t0 < 4.0
    t0 = time.monotonic()
    assert buf.take(2, current_version=1, timeout=0.05) == []
    assert time.monotonic() - t0 >= 0.04


def test_concurrent_add_and_take_lose_nothing(scored_group) -> None:
    buf = ReplayBuffer(capacity=100_000, max_staleness=1000)
    n_threads, per_thread = 4, 300
    taken: list[str] = []
    done = threading.Event()

    def producer(k: int) -> None:
        for i in range(per_thread):
            buf.add(scored_group([5], [[6]], [1.0], version=i % 7, rollout_id=f"{k}-{i}"))
            if i % 3 == 0:  # resends
                buf.add(scored_group([5], [[6]], [1.0], version=i % 7, rollout_id=f"{k}-{i}"))

    def consumer() -> None:
        while not done.is_set() or len(buf):
            taken.extend(x.rollout_id for x in buf.take(7, current_version=10))

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(n_threads)]
    cons = threading.Thread(target=consumer)
    cons.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    done.set()
    cons.join(timeout=20)
    assert not cons.is_alive()
    assert len(taken) == len(set(taken)) == n_threads * per_thread
    st = buf.stats()
    assert st.duplicates == n_threads * (per_thread // 3) and st.size == 0 and st.per_version == {}


def test_a_resize_never_drops_a_group_and_a_smaller_buffer_fills_no_further(g) -> None:
    buf = ReplayBuffer(capacity=2, max_staleness=10)
    buf.add(g(1, "a"))
    buf.add(g(1, "b"))
    buf.resize(4)  # more senders seen: more room at once
    assert buf.free_room() == 2
    buf.add(g(2, "c"))
    buf.add(g(2, "d"))
    buf.resize(2)  # fewer senders: nothing is dropped, there is no room
    assert len(buf) == 4 and buf.free_room() == 0 and buf.stats().evicted == 0
    assert buf.add(g(3, "e")) is AddResult.ADDED  # one in, the oldest out: no growth above the old size
    assert len(buf) == 4 and buf.stats().evicted == 1
    assert _ids(buf.take(3, current_version=3)) == ["b", "c", "d"]
    assert buf.free_room() == 1
    with pytest.raises(ValueError):
        buf.resize(0)
    buf.resize(1000)  # the default de-duplication window follows the capacity up, never down
    assert buf.seen_ids_window == 16_000
    buf.resize(2)
    assert buf.seen_ids_window == 16_000
    assert ReplayBuffer(capacity=2, max_staleness=1, seen_ids_window=10).seen_ids_window == 10


def test_recommended_capacity() -> None:
    assert recommended_capacity(batch_groups=16, max_staleness=0, num_inference_peers=4) == 20
    assert recommended_capacity(16, 2, 4, groups_per_push=2) == 56
    assert recommended_capacity(16, 2, 0, reuse=2) == 24
    with pytest.raises(ValueError):
        recommended_capacity(0, 1, 1)


def test_buffer_module_does_not_import_torch() -> None:
    code = "import sys, echo_p2p.train.buffer, echo_p2p.train; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_newest_order_hands_out_the_freshest_groups_and_still_evicts_the_oldest(g) -> None:
    buf = ReplayBuffer(capacity=4, max_staleness=10, order="newest")
    for v, rid in [(1, "a"), (2, "b"), (3, "c"), (4, "d")]:
        assert buf.add(g(v, rid)) is AddResult.ADDED
    assert _ids(buf.take(2, current_version=5)) == ["d", "c"]
    assert buf.stats().per_version == {1: 1, 2: 1}
    for v, rid in [(5, "e"), (6, "f"), (7, "h")]:
        assert buf.add(g(v, rid)) is AddResult.ADDED  # the third one evicts the oldest (version 1)
    assert buf.stats().evicted == 1
    assert _ids(buf.take(10, current_version=7)) == ["h", "f", "e", "b"]
    with pytest.raises(ValueError):
        ReplayBuffer(capacity=1, max_staleness=0, order="random")
