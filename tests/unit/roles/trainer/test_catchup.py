"""A trainer behind the run: it goes on after a version nobody alive holds, and looks only when it must."""

from __future__ import annotations

import logging


def test_a_trainer_behind_a_version_nobody_alive_holds_goes_on_after_it():
    """The publisher died while the other trainer was behind it: nobody can give that state any more."""
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord, PolicyRecord
    from echo_p2p.roles.trainer.catchup import orphaned_version

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
    from echo_p2p.roles.trainer.catchup import CatchUp

    dead, me = (str(load_or_create_identity(None).peer_id) for _ in range(2))

    class Stepper:
        version = 6
        downloads = 0

        def catch_up(self, force=False):
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


def test_a_trainer_whose_progress_reads_miss_a_live_trainer_ahead_downloads_its_state_when_refusing_rollouts(
    caplog,
):
    """The progress records do not show the trainer behind (its reads missed its partner's epoch), yet the
    samplers hold a newer version: pushes are refused as future_version and a live trusted trainer announces
    that version. The trainer downloads the state anyway (a fresh-clone run froze for two minutes: the late
    trainer at 62 refused every rollout of 63, the samplers pushed it nothing else, its partner starved)."""
    from types import SimpleNamespace

    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord, PolicyRecord
    from echo_p2p.roles.trainer.catchup import CatchUp, live_trainer_ahead

    partner, me, stranger = (str(load_or_create_identity(None).peer_id) for _ in range(3))
    trust = RunTrust(fixed=TrustedTrainers.from_keys([partner, me]))

    class Stepper:
        version = 62
        asked: list = []

        def catch_up(self, force=False):
            self.asked.append(force)
            if force:
                self.version = 63
            return force  # the progress records say nothing: only a forced download loads

        def advance_to(self, version):
            raise AssertionError("a live trainer holds the state: never go on alone")

    records = [
        PeerRecord(peer_id=me, role="trainer", policy_version=62),
        PeerRecord(peer_id=partner, role="trainer", policy_version=63),
    ]
    directory = SimpleNamespace(
        trainers=lambda: [SimpleNamespace(record=r) for r in records],
        policies=lambda: [SimpleNamespace(record=PolicyRecord(peer_id=partner, stream_id="s", version=63))],
    )
    stepper, reached, refused = Stepper(), [], [0]
    catch_up = CatchUp(
        me, stepper, lambda v: reached.append(v) or True, SimpleNamespace(record=lambda *span: None), directory,
        trust, lambda: refused[0], prefix=lambda: f"[trainer v{stepper.version}]",
    )  # fmt: skip
    catch_up.maybe(idle_since=-1e9)  # nothing refused: no forced download
    assert stepper.asked == [False] and stepper.version == 62
    catch_up._next_at = 0.0
    refused[0] = 50
    with caplog.at_level(logging.INFO, logger="echo_p2p.roles.trainer.catchup"):
        catch_up.maybe(idle_since=-1e9)
    assert stepper.asked == [False, False, True] and stepper.version == 63 and reached == [63]
    # the log prefix is read when the line is written: the version it names is the one reached (it once
    # named the version the trainer was built at, "[trainer v460] caught up ... 808 -> 816")
    assert "[trainer v63] caught up with the other trainers: version 62 -> 63" in caplog.text
    assert catch_up.downloads == 1 and catch_up.went_on_alone == 0
    # only a running, trusted trainer other than this one, ahead of it, counts
    assert live_trainer_ahead(me, 62, records, trust)
    assert not live_trainer_ahead(me, 63, records, trust)
    assert not live_trainer_ahead(partner, 63, records, trust)
    leaving = [PeerRecord(peer_id=partner, role="trainer", state="leaving", policy_version=70)]
    assert not live_trainer_ahead(me, 62, leaving, trust)
    forged = [PeerRecord(peer_id=stranger, role="trainer", policy_version=10**6)]
    assert not live_trainer_ahead(me, 62, forged, trust)
