"""A gradient round's group is assembled as soon as every trainer the progress records show has joined, not at
the end of the matchmaking time (real ``TaggedGradientAverager``s on two in-process hivemind DHTs, 127.0.0.1).

Before: hivemind assembled every group when its leader's ``min_matchmaking_time`` ran out, whoever had joined,
so every epoch of two trainers waited that long (1 s by default; 1.3 s of a trainer's 1.8 s median step in a
fault-free soak, docs/reliability.md)."""

from __future__ import annotations

import time

import pytest
import torch

from echo_p2p.collab.averagers import TaggedGradientAverager, group_size
from tests.unit.collab.pairs import averager_pair

MATCHMAKING_S = 5.0  # long, so that a round assembled when full is told apart from one assembled at the end


@pytest.fixture
def averagers():
    with averager_pair(
        TaggedGradientAverager, "group-size-test", min_matchmaking_time=MATCHMAKING_S, request_timeout=1.0
    ) as pair:
        yield pair


def _round(averagers, trainers: int) -> float:
    """Seconds until both averagers finished one round, each told the run has ``trainers`` trainers."""
    for averager in averagers:
        averager.group_size_fn = lambda: trainers
        averager.accumulate_grads_(batch_size=1)
    t0 = time.monotonic()
    controls = [averager.step(wait=False, timeout=3 * MATCHMAKING_S) for averager in averagers]
    for control in controls:
        control.result(3 * MATCHMAKING_S)
    elapsed = time.monotonic() - t0
    for averager in averagers:
        with averager.get_tensors() as averaged:
            assert all(torch.allclose(t, torch.full_like(t, 1.5)) for t in averaged), (
                "not the average of both"
            )
    return elapsed


def test_a_round_of_every_known_trainer_begins_once_all_joined_and_a_missing_one_is_waited_for_no_longer(
    averagers,
) -> None:
    assert (
        group_size(1) is None and group_size(0) is None and group_size(3) == 3
    )  # alone: nothing to wait for
    full = _round(averagers, trainers=2)
    assert full < MATCHMAKING_S / 2, f"a group of all known trainers waited {full:.1f} s to begin"
    # one more trainer in the records than in the swarm (it left; its record has not expired): the group of
    # the two that are there is assembled when the matchmaking time ends, as without a size
    short = _round(averagers, trainers=3)
    assert short >= MATCHMAKING_S - 0.5, f"a group short of a known trainer began after {short:.1f} s"
