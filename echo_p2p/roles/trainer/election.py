"""Which trainer publishes: exactly one at a time, the same choice on every trainer.

Owned here: ``elect_publisher``, a pure function of the trainers' directory records, the run's trust, the
version this trainer holds and the run's pace (no I/O: ``TrainerPeer`` reads the records on its heartbeat and
calls it), and ``version_rate``, that pace from a trainer's own steps. The publisher is the running trusted
trainer with the smallest peer id among those not behind the others, so that inference peers see one
consistent manifest per version; the others take over when it leaves. See docs/protocol.md (publishing).
"""

from __future__ import annotations

from collections.abc import Iterable

#: Versions a trainer's announced version may trail another's announced at the same time and still be
#: elected publisher: trainers that average together are one epoch apart, and a record is read a little
#: after it was stored.
PUBLISHER_SLACK = 10
#: Seconds of a trainer's own steps that ``version_rate`` looks at.
RATE_WINDOW_S = 30.0


def elect_publisher(
    peer_id: str,
    records,
    trust,
    version: int | None = None,
    rate: float = 0.0,
    now: float | None = None,
) -> bool:
    """Whether ``peer_id`` (holding ``version``) publishes: among the running trusted trainers not behind
    another one, the one with the smallest peer id does, the same choice on every trainer.

    Trusted: listed by the run record or the trusted-trainers file (``trust``; None: everyone); a record
    that only says ``role: trainer`` takes no part, so an impostor (or a ghost record it left) cannot
    silence the run's publisher. A trainer that is not trusted itself never publishes.

    Behind: another trainer's record shows more than ``PUBLISHER_SLACK`` versions more, plus what the run
    moves between the two records' times (``updated_at``) at the run's pace. A record is stored once a
    heartbeat, so two trainers in step announce versions up to a heartbeat apart: the tiny model moves 3-5
    versions a second, 10-25 per heartbeat. Compared without their times (as before), the trainer that read
    its own fresh record beside the other's older one judged the other behind and published too, and the
    mirror reading made both stand by. The pace is the largest ``versions_per_second`` the records announce
    (each trainer's own over its last 30 s of steps), so every reader of the same records judges with the
    same one; ``rate``, the reader's own pace, counts only while its record is not in ``records`` or no
    record announces one (older peers). With each reader's own pace (as before), a trainer that had just
    joined (no pace yet, or the slow one of two averaging trainers) and one that had stepped alone (several
    versions a second) judged a gap of 10-20 versions differently: both stood by (``publisher: False`` on
    both at the end of a CI run's late-trainer test). A trainer still at version 0 (the initial weights:
    one that joined and has not downloaded the run's state yet) has no slack: elected, it published its
    initial weights and the trainer that held the run stood by until it caught up. Not behind: a trainer
    that joins a running run (or fell behind) leaves publishing to one that holds the newest version until
    it has caught up, so no older version is announced in between. A record's time is taken as at most
    ``now`` (the reader's clock; DHT nodes agree within hivemind's 3 s): one dated in the future would
    excuse any lag behind it.
    """
    if trust is not None and not trust.is_trusted(peer_id):
        return False
    latest = float("inf") if now is None else now
    running = [
        r
        for r in records
        if r.role == "trainer" and r.state == "running" and (trust is None or trust.is_trusted(r.peer_id))
    ]
    held = {r.peer_id: (r.policy_version or 0, min(r.updated_at, latest)) for r in running}
    paces = [r.versions_per_second for r in running if r.versions_per_second is not None]
    if peer_id not in held:  # not announced yet: what we hold now. Otherwise every trainer compares the same
        at = now if now is not None else max((t for _, t in held.values()), default=0.0)  # records, so they
        held[peer_id] = (version or 0, at)  # make the same choice
        paces.append(rate)
    pace = max(paces) if paces else rate

    def behind(v: int, at: float) -> bool:
        slack = PUBLISHER_SLACK if v > 0 else 0
        return any(other - v > slack + max(0.0, pace) * max(0.0, when - at) for other, when in held.values())

    eligible = [p for p, (v, at) in held.items() if not behind(v, at)]
    return peer_id in eligible and min(eligible) == peer_id


def version_rate(history: Iterable[tuple[float, int]], window: float = RATE_WINDOW_S) -> float:
    """Versions per second over the last ``window`` seconds of ``history`` ((time, version) of this
    trainer's steps, oldest first); 0.0 with fewer than two steps in it. A trainer announces it in its record
    (``PeerRecord.versions_per_second``) and the election takes the largest announced."""
    points = list(history)
    if len(points) < 2:
        return 0.0
    end_t, end_v = points[-1]
    start_t, start_v = next((t, v) for t, v in points if t >= end_t - window)  # the last one at least
    if end_t <= start_t:
        return 0.0
    return max(0.0, (end_v - start_v) / (end_t - start_t))
