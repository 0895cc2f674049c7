"""A lone trainer's progress record is stored at most once per ``lone_interval``; with another trainer known,
at every report (as hivemind does); shutdown is never held back."""

from __future__ import annotations

import time

from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from echo_p2p.collab.progress import PacedProgressTracker


async def _done(value):
    return value


class FakeDHT:
    """The part of ``hivemind.DHT`` a progress tracker uses: stores land in a dict that reads return, with
    the records of ``others`` (other trainers) added."""

    client_mode = False

    def __init__(self) -> None:
        self.peer_id = PeerID(b"me")
        self.stored: dict = {}
        self.stores = 0
        self.others: dict = {}

    def add_validators(self, validators) -> None:
        pass

    def get(self, key, latest=False, return_future=False):
        records = {**self.stored, **self.others}
        found = ValueWithExpiration(records, get_dht_time() + 30) if records else None
        return _done(found) if return_future else found

    def store(self, key, subkey, value, expiration_time, return_future=False):
        self.stores += 1
        self.stored[subkey] = ValueWithExpiration(value, expiration_time)
        return _done(True)


def _other_trainer() -> dict:
    progress = LocalTrainingProgress(
        peer_id=b"other", epoch=0, samples_accumulated=0, samples_per_second=1.0, time=get_dht_time(),
        client_mode=False,
    )  # fmt: skip
    return {b"other-key": ValueWithExpiration(progress.dict(), get_dht_time() + 30)}


def _report_for(tracker: PacedProgressTracker, seconds: float, period: float) -> int:
    reports, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        reports += 1
        tracker.report_local_progress(local_epoch=tracker.local_progress.epoch, samples_accumulated=reports)
        time.sleep(period)
    return reports


def test_a_lone_trainer_stores_its_progress_once_per_interval_and_at_every_report_once_not_alone() -> None:
    dht = FakeDHT()
    tracker = PacedProgressTracker(
        dht=dht, prefix="run", target_batch_size=10**6, lone_interval=0.5, min_refresh_period=0.05,
        max_refresh_period=0.1, default_refresh_period=0.05, metadata_expiration=30.0, start=True,
    )  # fmt: skip
    try:
        before = dht.stores
        reports = _report_for(tracker, 1.2, 0.02)
        time.sleep(0.2)
        lone_stores = dht.stores - before
        assert reports >= 30 and 1 <= lone_stores <= 4, (reports, lone_stores)
        assert tracker.reports_not_stored >= reports - 4

        dht.others = _other_trainer()  # the next progress read counts two trainers
        deadline = time.monotonic() + 5
        while tracker.global_progress.num_peers < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tracker.global_progress.num_peers == 2
        before = dht.stores
        reports = _report_for(tracker, 1.0, 0.1)
        time.sleep(0.2)
        assert dht.stores - before >= reports - 2, (reports, dht.stores - before)
        # the stored record is the newest report's
        assert max(v.value["samples_accumulated"] for k, v in dht.stored.items()) == reports
    finally:
        dht.others = {}
        time.sleep(0.3)  # alone again: shutdown must still wake the reporter at once
        t0 = time.monotonic()
        tracker.shutdown(timeout=5)
        assert time.monotonic() - t0 < 2 and not tracker.is_alive()


def test_a_progress_read_counts_this_trainers_own_samples_from_its_local_progress_not_a_stale_record() -> (
    None
):
    """A lone trainer's stored record lags its reports (paced stores): a read between two stores used to count
    the stored samples, so an epoch's samples reported since were lost and the epoch not reached in time."""
    dht = FakeDHT()
    tracker = PacedProgressTracker(
        dht=dht, prefix="run", target_batch_size=4, lone_interval=3600.0, min_refresh_period=0.05,
        max_refresh_period=0.1, default_refresh_period=0.05, metadata_expiration=30.0, start=False,
    )  # fmt: skip
    stale = LocalTrainingProgress(
        peer_id=dht.peer_id.to_bytes(), epoch=1, samples_accumulated=0, samples_per_second=1.0,
        time=get_dht_time(), client_mode=False,
    )  # fmt: skip
    tracker.local_progress = tracker._get_local_progress(1, 3)  # three samples reported since the store
    records = {b"my-key": ValueWithExpiration(stale.dict(), get_dht_time() + 30), **_other_trainer()}
    progress = tracker._parse_swarm_progress_data(records)
    assert progress.epoch == 1 and progress.samples_accumulated == 3 and progress.num_peers == 2
    # hivemind's own reading counts the stale record: none of the three
    plain = super(PacedProgressTracker, tracker)._parse_swarm_progress_data(records)
    assert plain.samples_accumulated == 0
