"""Which trainer publishes: the smallest running trusted trainer that is not behind the newest version."""

from __future__ import annotations


def test_the_smallest_running_trusted_trainer_is_elected_publisher():
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.records import PeerRecord
    from echo_p2p.roles.trainer.election import elect_publisher

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
    from echo_p2p.roles.trainer.election import PUBLISHER_SLACK, elect_publisher

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
    from echo_p2p.roles.trainer.election import PUBLISHER_SLACK, elect_publisher

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
