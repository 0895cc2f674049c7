"""Which trainer publishes: the smallest running trusted trainer that is not behind the newest version."""

from __future__ import annotations


def two_trainers():
    """Two trusted trainers' peer ids, the smaller first, and the trust that lists them."""
    from echo_p2p.guard.trust import RunTrust, TrustedTrainers
    from echo_p2p.net.identity import load_or_create_identity

    small, large = sorted(str(load_or_create_identity(None).peer_id) for _ in range(2))
    return small, large, RunTrust(fixed=TrustedTrainers.from_keys([small, large]))


def announced(peer_id: str, version: int, at: float, pace: float | None = None):
    """A running trainer's record: ``version`` announced at time ``at``, its pace ``pace`` (versions/s)."""
    from echo_p2p.net.records import PeerRecord

    return PeerRecord(
        peer_id=peer_id, role="trainer", policy_version=version, updated_at=at, versions_per_second=pace
    )


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
    from echo_p2p.net.records import PeerRecord
    from echo_p2p.roles.trainer.election import PUBLISHER_SLACK, elect_publisher

    late, early, trust = two_trainers()
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
    from echo_p2p.net.records import PeerRecord
    from echo_p2p.roles.trainer.election import PUBLISHER_SLACK, elect_publisher

    late, early, trust = two_trainers()
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


def test_trainers_in_step_agree_whichever_record_each_read_fresher():
    """Records are stored once a heartbeat: a trainer may read its own record fresh beside the other's from
    a heartbeat ago, and the other trainer the mirror image. At 5 versions a second and 3 s apart, the one
    with the older record trails by 15 versions. Without the records' times each reader judged the other
    behind: both published (seen in the late-trainer run: ``publisher: True`` on both for 11 s), or in the
    mirror case neither did."""
    from echo_p2p.roles.trainer.election import elect_publisher

    small, large, trust = two_trainers()

    def seen(fresh: str, stale: str) -> list:
        return [announced(fresh, 115, 1003.0), announced(stale, 100, 1000.0)]

    # what each reader concluded before: the records alone, no pace
    assert elect_publisher(large, seen(large, small), trust, rate=0.0)  # "small is behind": large publishes
    assert elect_publisher(small, seen(small, large), trust, rate=0.0)  # and small publishes too
    # now: 15 versions in 3 s is the run's own pace, nobody is behind, the smallest id publishes on both
    # readers, each with its own estimate of the pace
    for records in (seen(large, small), seen(small, large)):
        assert elect_publisher(small, records, trust, rate=4.6, now=1003.5)
        assert not elect_publisher(large, records, trust, rate=5.4, now=1003.5)
    # a trainer really behind stays behind: 40 versions where the pace explains 15
    behind = [announced(large, 140, 1003.0), announced(small, 100, 1000.0)]
    assert not elect_publisher(small, behind, trust, rate=5.0)
    assert elect_publisher(large, behind, trust, rate=5.0)
    # the leader's record dated in the future (a clock or a bug) excuses no lag behind it: its time counts as
    # the reader's now (else an hour at 5 versions a second excused 18,000 versions)
    future = [announced(large, 140, 1003.0 + 3600), announced(small, 100, 1000.0)]
    assert not elect_publisher(small, future, trust, rate=5.0, now=1003.5)
    assert elect_publisher(large, future, trust, rate=5.0, now=1003.5)


def test_trainers_with_different_paces_of_their_own_judge_with_the_records_and_agree():
    """The pace comes from the records (the largest announced), not from each reader's own steps. With its
    own, a trainer that had just joined (a pace of 0.5 versions/s: few steps, averaging with the other) and
    one that had stepped alone (4/s) judged the same 15-version gap between records 2 s apart differently:
    the joiner thought itself behind (15 > 10 + 1) and stood by, the other thought it was not (15 <= 10 + 8)
    and stood by for it, so nobody published (both ``publisher: False`` at the end of a CI run's late-trainer
    test)."""
    from echo_p2p.roles.trainer.election import elect_publisher

    joiner, other, trust = two_trainers()  # the joiner has the smaller id
    # before: the same records without paces, each reader with its own
    plain = [announced(other, 130, 1002.0), announced(joiner, 115, 1000.0)]
    assert not elect_publisher(joiner, plain, trust, rate=0.5, now=1002.5)
    assert not elect_publisher(other, plain, trust, rate=4.0, now=1002.5)  # nobody publishes
    # now: each record carries its trainer's pace, every reader judges with the largest, whatever its own
    records = [announced(other, 130, 1002.0, pace=4.0), announced(joiner, 115, 1000.0, pace=0.5)]
    for joiner_rate, other_rate in ((0.5, 4.0), (0.0, 9.0), (4.0, 0.5)):
        assert elect_publisher(joiner, records, trust, rate=joiner_rate, now=1002.5)
        assert not elect_publisher(other, records, trust, rate=other_rate, now=1002.5)
    # really behind at that pace: 40 versions where it explains 8; both see it
    behind = [announced(other, 155, 1002.0, pace=4.0), announced(joiner, 115, 1000.0, pace=0.5)]
    assert not elect_publisher(joiner, behind, trust, rate=0.5, now=1002.5)
    assert elect_publisher(other, behind, trust, rate=0.5, now=1002.5)
    # a record that announces no pace (an older peer) lends none: the largest announced is the other's
    older = [announced(other, 130, 1002.0, pace=4.0), announced(joiner, 115, 1000.0)]
    assert elect_publisher(joiner, older, trust, rate=0.0, now=1002.5)
    assert not elect_publisher(other, older, trust, rate=0.0, now=1002.5)


def test_a_trainer_at_version_0_has_no_slack_but_its_records_age_counts():
    from echo_p2p.roles.trainer.election import elect_publisher

    small, large, trust = two_trainers()
    # the run's first seconds: the small one's record still says 0 from a second before the other's 2
    start = [announced(small, 0, 10.0), announced(large, 2, 11.0)]
    assert elect_publisher(small, start, trust, rate=3.0)
    assert not elect_publisher(large, start, trust, rate=3.0)
    # a newcomer at 0 beside a run at 5 a second later: 5 versions where the pace explains 3
    joined = [announced(small, 0, 100.0), announced(large, 5, 101.0)]
    assert not elect_publisher(small, joined, trust, rate=3.0)
    assert elect_publisher(large, joined, trust, rate=3.0)


def test_the_pace_is_versions_per_second_over_the_recent_steps():
    from echo_p2p.roles.trainer.election import version_rate

    assert version_rate([]) == 0.0 and version_rate([(5.0, 3)]) == 0.0
    steps = [(float(t), 2 * t) for t in range(100)]  # 2 versions a second for 100 s
    assert version_rate(steps) == 2.0
    slowed = steps + [(100.0 + 10 * i, 200 + i) for i in range(1, 4)]  # then 0.1/s for 30 s
    assert abs(version_rate(slowed, window=30.0) - 3 / 30) < 1e-9
    assert version_rate([(1.0, 5), (1.0, 6)]) == 0.0  # no time between them: no estimate
