"""Which trainer publishes: exactly one at a time, the same choice on every trainer.

Owned here: ``elect_publisher``, a pure function of the trainers' directory records, the run's trust and the
version this trainer holds (no I/O: ``TrainerPeer`` reads the records on its heartbeat and calls it). The
publisher is the running trusted trainer with the smallest peer id among those not behind the newest
version, so that inference peers see one consistent manifest per version; the others take over when it
leaves. See docs/protocol.md (publishing).
"""

from __future__ import annotations

#: Versions a trainer's announced version may trail the newest one and still be elected publisher: trainers
#: that average together are one epoch apart, but their records are up to a heartbeat old each, and a fast
#: run (the tiny model: ~3 versions/s) moves several versions per heartbeat.
PUBLISHER_SLACK = 10


def elect_publisher(peer_id: str, records, trust, version: int | None = None) -> bool:
    """Whether ``peer_id`` (holding ``version``) publishes: among the running trusted trainers whose records
    are not behind the newest one (by more than ``PUBLISHER_SLACK`` versions), the one with the smallest peer
    id does, the same choice on every trainer.

    Trusted: listed by the run record or the trusted-trainers file (``trust``; None: everyone); a record
    that only says ``role: trainer`` takes no part, so an impostor (or a ghost record it left) cannot
    silence the run's publisher. A trainer that is not trusted itself never publishes. Not behind: a
    trainer that joins a running run (or fell behind) leaves publishing to one that holds the newest
    version until it has caught up, so no older version is announced in between.
    """
    if trust is not None and not trust.is_trusted(peer_id):
        return False
    held = {
        r.peer_id: r.policy_version or 0
        for r in records
        if r.role == "trainer" and r.state == "running" and (trust is None or trust.is_trusted(r.peer_id))
    }
    if peer_id not in held:  # not announced yet: what we hold. Otherwise every trainer compares the same
        held[peer_id] = version or 0  # records (a heartbeat old), so they all make the same choice
    newest = max(held.values())
    # version 0 is the initial weights: a trainer still there while another moved on (one that just joined
    # a young run, within the slack) has none of the run's updates; elected, it published its initial
    # weights and the trainer that held the run stood by until it caught up (a gap in the run's versions)
    eligible = [p for p, v in held.items() if v >= newest - PUBLISHER_SLACK and (v > 0 or newest == 0)]
    return peer_id in eligible and min(eligible) == peer_id
