"""When the trainer publishes: every version by default, in line in sync mode, in the background in async mode
with at most one publish in flight, no more often than ``publish_interval`` when set; a standby trainer never."""

from __future__ import annotations

import concurrent.futures
import threading

import torch

from echo_p2p.roles.trainer.peer import TrainerPeer
from echo_p2p.roles.trainer.publishing import PublishSchedule
from tests.unit.conftest import unstarted_peer


class FakePublisher:
    """Records what it was handed; a background publish waits for ``release``."""

    def __init__(self):
        self.published: list[int] = []
        self.stream_id = "a1"  # WeightPublisher.stream_id
        self.release = threading.Event()
        self.release.set()
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def publish(self, tensors, version):
        list(tensors)
        self.published.append(version)

    def publish_in_background(self, tensors, version):
        list(tensors)
        return self.pool.submit(lambda: (self.release.wait(10), self.published.append(version)))


def tensors():
    return iter([("w", torch.zeros(2))])


def drain(schedule: PublishSchedule) -> None:
    if schedule.in_flight is not None:
        schedule.in_flight.result(timeout=10)


def test_sync_publishes_every_version_in_line():
    schedule = PublishSchedule(FakePublisher(), in_background=False, interval=5.0)  # the interval is async's
    for v in range(3):
        assert schedule.maybe(v, tensors)
    assert not schedule.maybe(2, tensors)  # published already
    assert schedule.publisher.published == [0, 1, 2] and schedule.published == 3


def test_async_publishes_in_the_background_one_at_a_time_newest_next():
    schedule = PublishSchedule(FakePublisher(), in_background=True)
    schedule.publisher.release.clear()  # the first publish hangs until released
    assert schedule.maybe(0, tensors)
    taken = []
    for v in (1, 2, 3):  # versions made while it is in flight are not queued, nor their weights read
        assert not schedule.maybe(v, lambda v=v: taken.append(v) or tensors())
    assert taken == []
    schedule.publisher.release.set()
    drain(schedule)
    assert schedule.maybe(3, tensors)  # the idle loop or the next step sends the newest
    drain(schedule)
    assert schedule.publisher.published == [0, 3] and schedule.published == 2


def test_a_failed_background_publish_is_logged_and_the_next_version_goes_out(caplog):
    class Failing(FakePublisher):
        def publish_in_background(self, tensors, version):
            if version == 0:
                return self.pool.submit(lambda: 1 / 0)
            return super().publish_in_background(tensors, version)

    schedule = PublishSchedule(Failing(), in_background=True)
    schedule.maybe(0, tensors)
    concurrent.futures.wait([schedule.in_flight], timeout=10)
    assert schedule.maybe(1, tensors)
    drain(schedule)
    assert schedule.publisher.published == [1]
    assert "publishing a version failed" in caplog.text


def test_publish_interval_spaces_publishes():
    now = [100.0]
    schedule = PublishSchedule(FakePublisher(), in_background=True, interval=1.0, clock=lambda: now[0])
    for step in range(10):  # ten versions in 0.9 s: one publish
        schedule.maybe(step, tensors)
        drain(schedule)
        now[0] += 0.1
    now[0] += 0.2
    schedule.maybe(9, tensors)
    drain(schedule)
    assert schedule.publisher.published == [0, 9]


def test_a_trainer_publishes_only_while_it_is_the_elected_publisher(tmp_path):
    peer = unstarted_peer(TrainerPeer, tmp_path)
    peer.model = torch.nn.Linear(2, 2)
    peer.publishing = PublishSchedule(FakePublisher(), in_background=False)
    peer.policy_version = 4
    peer.is_publisher = False  # stands by
    peer._maybe_publish()
    assert peer.publishing.publisher.published == []
    peer.is_publisher = True  # elected: the version it holds goes out
    peer._maybe_publish()
    assert peer.publishing.publisher.published == [4]
    assert peer._counters()["versions_published"] == 1


def test_the_weights_of_a_version_are_known_when_published_on_the_groups_stream_or_shared_by_the_round(
    tmp_path,
):
    """The sender guard strikes for replayed draws only under weights known to be the group's sampler's: a
    version this trainer published, since its last state download, on the stream the group names, or one
    whose state every trainer of its round held. The hour soak of 2026-12-07 banned honest samplers three
    times: a restarted trainer judged draws sampled under another trainer's weights of the same number, under
    its own diverged copy of a version it then downloaded, and under its killed incarnation's weights; the
    hour at 9af02c6 once more, under the weights a round shared of a number it had published from its own
    lineage just before downloading the others'."""
    from types import SimpleNamespace

    peer = unstarted_peer(TrainerPeer, tmp_path)
    peer.model = torch.nn.Linear(2, 2)
    publisher = FakePublisher()
    peer.publishing = PublishSchedule(publisher, in_background=False)
    shared = {9}
    stepper = SimpleNamespace(
        state_downloads=0, download_pending=False, state_shared=lambda version: version in shared
    )
    peer._stepper = stepper
    peer.is_publisher = True

    def group(version, stream):
        return SimpleNamespace(policy_version=version, weights_stream=stream)

    for version in (4, 5):
        peer.policy_version = version
        peer._maybe_publish()
    publisher.stream_id = "b2"  # the encoder restarted its stream
    peer.policy_version = 6
    peer._maybe_publish()
    assert publisher.published == [4, 5, 6]
    assert peer._weights_known(group(4, "a1")) and peer._weights_known(group(6, "b2"))
    assert not peer._weights_known(group(7, "a1"))  # never published by this trainer
    assert peer._weights_known(group(9, "zz"))  # 9: shared by the round that left it, whoever published it
    # another stream, or none, for a version it published: another trainer, or its own killed incarnation,
    # may have published other weights under that number; the group is not judged by the replay
    assert not peer._weights_known(group(5, "other")) and not peer._weights_known(group(5, ""))
    assert peer._weights_known(group(5, "a1"))  # its own stream still is
    from echo_p2p.train.past_weights import PastWeights

    past = PastWeights(peer.model, keep=4, budget_mb=1)
    peer.learner = SimpleNamespace(past=past)
    past.record(6)  # the learner's copy of version 6: this trainer's own weights of it
    stepper.state_downloads = 1  # a download replaced its state, maybe under version 6 itself
    peer._forget_if_replaced()  # as the trainer does after each step, before the guard judges
    assert not peer._weights_known(group(5, "a1")) and not peer._weights_known(group(6, "b2"))
    assert 6 not in past  # the next step records the downloaded weights, not the old copy kept
    assert peer._weights_known(group(9, "a1"))
    # a later round shares 6 (the downloaded weights): the samplers holding the 6 this trainer published on
    # "b2" before the download had other weights; another stream's 6 may be the shared one
    shared.add(6)
    assert not peer._weights_known(group(6, "b2")) and peer._weights_known(group(6, "c3"))
    # a trainer that knows its state is off the others' publishes nothing until the download replaced it
    stepper.download_pending = True
    peer.policy_version = 7
    peer._maybe_publish()
    stepper.download_pending = False
    assert publisher.published == [4, 5, 6]
    peer._maybe_publish()
    assert publisher.published == [4, 5, 6, 7] and peer._weights_known(group(7, "b2"))


def test_a_stopping_trainer_or_a_failed_directory_read_never_changes_the_publisher_role(tmp_path):
    """At a stop the DHT may be gone: a read that finds no other trainer must not make a trainer that stood by
    the publisher in its last lines (two publishers at the end of a two-trainer run)."""

    class Directory:
        def __init__(self, entries=None, error=None):
            self.entries, self.error = entries or [], error

        def trainers(self):
            if self.error:
                raise self.error
            return self.entries

    peer = unstarted_peer(TrainerPeer, tmp_path)
    peer.is_publisher = False
    peer.directory = Directory()  # nobody else found: a running trainer takes the role
    peer._update_publisher_role()
    assert peer.is_publisher
    peer.is_publisher = False
    peer.directory = Directory(error=TimeoutError("the DHT is down"))
    peer._update_publisher_role()
    assert not peer.is_publisher  # a failed read keeps the role
    peer.directory = Directory()
    peer.stop_event.set()
    peer._update_publisher_role()
    assert not peer.is_publisher  # stopping: no change
