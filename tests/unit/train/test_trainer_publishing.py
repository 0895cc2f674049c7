"""When the trainer publishes: every version by default, in the background in async mode, at most one
publish in flight, and no more often than ``publish_interval`` when set."""

from __future__ import annotations

import concurrent.futures
import threading

import torch

from echo_p2p.config import TrainerSection
from echo_p2p.roles.trainer import TrainerPeer


class FakePublisher:
    def __init__(self):
        self.published: list[int] = []
        self.release = threading.Event()
        self.release.set()
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def publish(self, tensors, version):
        self.published.append(version)

    def publish_in_background(self, tensors, version):
        list(tensors)
        return self.pool.submit(lambda: (self.release.wait(10), self.published.append(version)))


def trainer(mode: str, **section) -> TrainerPeer:
    peer = TrainerPeer.__new__(TrainerPeer)
    peer.config = type("C", (), {"mode": mode})()
    peer.section = TrainerSection(**section)
    peer.is_publisher = True
    peer.publisher = FakePublisher()
    peer.model = torch.nn.Linear(2, 2)
    peer.publish_seconds = 0.0
    peer._published_version = None
    peer._publishing = None
    peer._published_at = -float("inf")
    peer.versions_published = 0
    peer.policy_version = 0
    return peer


def drain(peer):
    if peer._publishing is not None:
        peer._publishing.result(timeout=10)


def test_sync_publishes_every_version_in_line():
    peer = trainer("sync")
    for v in range(3):
        peer.policy_version = v
        peer._maybe_publish()
    assert peer.publisher.published == [0, 1, 2] and peer.versions_published == 3


def test_async_publishes_in_the_background_one_at_a_time_newest_next():
    peer = trainer("async")
    peer.publisher.release.clear()  # the first publish hangs until released
    peer._maybe_publish()
    for v in (1, 2, 3):  # versions made while it is in flight are not queued
        peer.policy_version = v
        peer._maybe_publish()
    peer.publisher.release.set()
    drain(peer)
    peer._maybe_publish()  # the idle loop or the next step sends the newest
    drain(peer)
    assert peer.publisher.published == [0, 3]


def test_publish_interval_spaces_publishes(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("echo_p2p.roles.trainer.time.monotonic", lambda: now[0])
    peer = trainer("async", publish_interval=1.0)
    for step in range(10):  # ten versions in 0.9 s: one publish
        peer.policy_version = step
        peer._maybe_publish()
        drain(peer)
        now[0] += 0.1
    now[0] += 0.2
    peer._maybe_publish()
    drain(peer)
    assert peer.publisher.published == [0, 9]


def test_a_standby_trainer_publishes_nothing():
    peer = trainer("async")
    peer.is_publisher = False
    peer._maybe_publish()
    assert peer.publisher.published == []


def test_a_fresh_trainer_starts_on_the_grid_its_receivers_hold():
    from echo_p2p.roles.trainer_weights import start_on_serving_grid

    torch.manual_seed(0)
    for encoding, dtype in (("auto", torch.bfloat16), ("patch", torch.bfloat16), ("fp16", torch.float16)):
        peer = trainer("async", encoding={"encoding": encoding, "serving_dtype": "bf16"})
        before = [p.detach().clone() for p in peer.model.parameters()]
        assert start_on_serving_grid(peer.model, peer.section.encoding) > 0
        for p, b in zip(peer.model.parameters(), before, strict=True):
            assert p.dtype == torch.float32
            assert torch.equal(p, p.to(dtype).float())  # the receivers' cast is exact at version 0
            assert torch.equal(p, b.to(dtype).float())  # round to nearest, nothing else
    peer = trainer("async", encoding={"encoding": "int8-delta"})  # fp32 receivers: left alone
    before = [p.detach().clone() for p in peer.model.parameters()]
    assert start_on_serving_grid(peer.model, peer.section.encoding) == 0
    assert all(torch.equal(p, b) for p, b in zip(peer.model.parameters(), before, strict=True))


def test_the_smallest_running_trusted_trainer_is_elected_publisher():
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord
    from echo_p2p.roles.trainer_weights import elect_publisher

    # ghost sorts first, claims to be a trainer and is not trusted
    ghost, a, b, c = sorted(str(load_or_create_identity(None).peer_id) for _ in range(4))
    records = [
        PeerRecord(peer_id=ghost, role="trainer"),
        PeerRecord(peer_id=a, role="trainer", state="leaving"),
        PeerRecord(peer_id=b, role="trainer"),
        PeerRecord(peer_id=c, role="trainer"),
    ]
    trust = RunTrust(fixed=TrustedTrainers.from_keys([a, b, c]))
    assert elect_publisher(b, records, trust)  # a is leaving, the ghost is not trusted
    assert not elect_publisher(c, records, trust)
    assert not elect_publisher(ghost, records, trust)  # an untrusted trainer never publishes
    assert elect_publisher(ghost, records, None)  # without trust, every announcement counts


def test_a_trainer_behind_the_newest_leaves_publishing_to_one_that_holds_it():
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord
    from echo_p2p.roles.trainer_weights import PUBLISHER_SLACK, elect_publisher

    late, early = sorted(str(load_or_create_identity(None).peer_id) for _ in range(2))
    trust = RunTrust(fixed=TrustedTrainers.from_keys([late, early]))
    newest = 40
    records = [
        PeerRecord(peer_id=early, role="trainer", policy_version=newest),
        PeerRecord(peer_id=late, role="trainer", policy_version=0),  # joined a running run
    ]
    assert not elect_publisher(late, records, trust, version=0)  # smallest id, but 40 versions behind
    assert elect_publisher(early, records, trust, version=newest)
    # both judge by the records alone (a heartbeat old), so they agree whatever each holds right now
    assert not elect_publisher(late, records, trust, version=newest) and elect_publisher(
        early, records, trust, 45
    )
    # caught up and announced: the smallest id publishes again, the other stands by
    records[1] = PeerRecord(peer_id=late, role="trainer", policy_version=newest - PUBLISHER_SLACK)
    assert elect_publisher(late, records, trust, version=newest)
    assert not elect_publisher(early, records, trust, version=newest)
    assert elect_publisher(late, records[1:], trust, version=0)  # alone in the directory: it publishes
    assert elect_publisher(late, records[:1], trust, version=0) is False  # not announced yet: its own version


def test_a_trainer_still_at_the_initial_weights_never_takes_publishing_from_one_that_moved_on():
    """A trainer that joins a young run (within PUBLISHER_SLACK versions of it) at version 0 has none of the
    run's updates: elected for its smaller id, it published its initial weights and the trainer that held
    the run stood by until the newcomer had downloaded the state (seen in a late-trainer run)."""
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord
    from echo_p2p.roles.trainer_weights import PUBLISHER_SLACK, elect_publisher

    late, early = sorted(str(load_or_create_identity(None).peer_id) for _ in range(2))
    trust = RunTrust(fixed=TrustedTrainers.from_keys([late, early]))
    young = PUBLISHER_SLACK // 2
    records = [
        PeerRecord(peer_id=early, role="trainer", policy_version=young),
        PeerRecord(peer_id=late, role="trainer", policy_version=0),
    ]
    assert not elect_publisher(late, records, trust, version=0)
    assert elect_publisher(early, records, trust, version=young)
    # a run where nobody moved yet: the smallest id publishes version 0, as before
    records[0] = PeerRecord(peer_id=early, role="trainer", policy_version=0)
    assert elect_publisher(late, records, trust, version=0) and not elect_publisher(early, records, trust, 0)


def test_a_trainer_behind_a_version_nobody_alive_holds_goes_on_after_it():
    """The publisher died while the other trainer was behind it: nobody can give that state any more."""
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord, PolicyRecord
    from echo_p2p.roles.trainer_weights import orphaned_version

    dead, me, stranger = (str(load_or_create_identity(None).peer_id) for _ in range(3))
    trust = RunTrust(fixed=TrustedTrainers.from_keys([dead, me]))
    policies = [
        PolicyRecord(peer_id=dead, stream_id="s1", version=10),
        PolicyRecord(peer_id=me, stream_id="s2", version=6),
    ]
    mine = PeerRecord(peer_id=me, role="trainer", policy_version=6)
    # the publisher of version 10 still has a running record (maybe a heartbeat old): catching up will do
    alive = [mine, PeerRecord(peer_id=dead, role="trainer", policy_version=6)]
    assert orphaned_version(me, 6, alive, policies, trust) is None
    # another live trainer ahead of us can give its state
    ahead = [
        mine,
        PeerRecord(peer_id=dead, role="trainer", state="leaving"),
        PeerRecord(peer_id=stranger, role="trainer", policy_version=9),
    ]
    assert (
        orphaned_version(
            me, 6, ahead, policies, RunTrust(fixed=TrustedTrainers.from_keys([dead, me, stranger]))
        )
        is None
    )
    # its record expired: go on as version 11, a number nobody published with other weights
    assert orphaned_version(me, 6, [mine], policies, trust) == 11
    # an untrusted peer's policy record or trainer record changes nothing
    forged = [*policies, PolicyRecord(peer_id=stranger, stream_id="x", version=10**6)]
    assert orphaned_version(me, 6, [mine, ahead[2]], forged, trust) == 11
    # not behind: nothing to do
    assert orphaned_version(me, 10, [mine], policies, trust) is None
    assert orphaned_version(me, 12, [mine], policies, trust) is None


def test_a_trainer_whose_catch_up_loads_nothing_goes_on_alone_only_after_new_future_version_refusals():
    """The trigger path of the rule above (``CatchUp``): the directory is read only when pushes were refused
    as future_version since the last look; then the trainer advances past the orphaned version and holds it."""
    from types import SimpleNamespace

    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord, PolicyRecord
    from echo_p2p.roles.trainer_catchup import CatchUp

    dead, me = (str(load_or_create_identity(None).peer_id) for _ in range(2))

    class Stepper:
        version = 6
        downloads = 0

        def catch_up(self):
            self.downloads += 1
            return False  # the donor is dead

        def advance_to(self, version):
            self.version = version
            return True

    class Directory:
        reads = 0

        def trainers(self):
            self.reads += 1
            return [SimpleNamespace(record=PeerRecord(peer_id=me, role="trainer", policy_version=6))]

        def policies(self):
            return [SimpleNamespace(record=PolicyRecord(peer_id=dead, stream_id="s", version=10))]

    stepper, directory, reached, spans, refused = Stepper(), Directory(), [], [], [0]
    drift = SimpleNamespace(record=lambda *span: spans.append(span))
    catch_up = CatchUp(
        me, stepper, lambda v: reached.append(v) or True, drift, directory,
        RunTrust(fixed=TrustedTrainers.from_keys([dead, me])), lambda: refused[0],
    )  # fmt: skip
    catch_up.maybe(idle_since=-1e9)  # loads nothing, nobody refused anything: the directory is not read
    assert stepper.downloads == 1 and directory.reads == 0 and reached == []
    catch_up._next_at = 0.0
    refused[0] = 3  # samplers hold version 10 and the ingest refuses their rollouts
    catch_up.maybe(idle_since=-1e9)
    assert directory.reads == 1 and stepper.version == 11 and reached == [11]
    assert spans == [(6, 11, None)] and catch_up.went_on_alone == 1 and catch_up.downloads == 0
    catch_up._next_at = 0.0
    catch_up.maybe(idle_since=-1e9)  # no new refusal: no new read
    assert directory.reads == 1 and stepper.downloads == 3
