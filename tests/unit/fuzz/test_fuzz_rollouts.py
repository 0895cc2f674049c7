"""Fuzz: the rollout parser (``RolloutGroup.from_bytes``) and the trainer's validator
(``IngestValidator.validate``) given what a hostile inference peer can send. Either a group or a
``ValueError`` from the parser; a ``ScoredGroup`` or a ``Rejection`` with a reason (never ``internal_error``,
which would be a bug) from the validator; nothing else, in bounded time and memory."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
from echo_p2p.ml.tokenizer import build_char_tokenizer
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.tasks.registry import build_task
from echo_p2p.train.scored import ScoredGroup
from echo_p2p.transport.rollouts.refusals import Reason, Rejection
from tests.unit.fuzz.fuzzing import FUZZ, HUGE_HEADERS, broken, hostile_bytes, packed, peak_allocated, values
from tests.unit.guard.test_rollout_checks import make_group

pytestmark = pytest.mark.timeout(120)
TOK = build_char_tokenizer()
TASK = build_task("count")
G, VERSION = 2, 5
VALIDATOR = IngestValidator(
    {"count": TASK}, TOK, IngestConfig(vocab_size=len(TOK), group_size=G, max_staleness=2)
)


HONEST = make_group(TOK, TASK, 7, texts=("cc", "c"), version=VERSION)
HONEST_BYTES = HONEST.to_bytes()
HONEST_DICT = HONEST.model_dump(mode="python")


def parse(data: bytes) -> RolloutGroup | None:
    try:
        group = RolloutGroup.from_bytes(data)
    except ValueError as exc:
        assert str(exc)  # a reason, never an empty message
        return None
    assert isinstance(group, RolloutGroup)
    return group


def check_verdict(group) -> None:
    verdict = VALIDATOR.validate(group, VERSION)
    assert isinstance(verdict, (ScoredGroup, Rejection))
    if isinstance(verdict, Rejection):
        assert verdict.reason is not Reason.INTERNAL_ERROR, verdict
    else:
        assert all(math.isfinite(r) for r in verdict.rewards)


def test_the_honest_group_is_accepted():  # the baseline the mutations start from
    assert isinstance(VALIDATOR.validate(parse(HONEST_BYTES), VERSION), ScoredGroup)


@FUZZ
@given(hostile_bytes(HONEST_BYTES, extra=st.builds(packed, broken(HONEST_DICT))))
def test_hostile_bytes_are_parsed_or_refused_and_every_group_gets_a_verdict(data):
    group = parse(data)
    if group is not None:
        check_verdict(group)


@FUZZ
@given(broken(HONEST_DICT))
def test_groups_with_broken_fields_get_a_verdict(record):
    try:
        group = RolloutGroup.model_validate(record)
    except ValueError:
        return
    check_verdict(group)


@FUZZ
@given(values)
def test_anything_that_is_not_a_group_is_refused_as_malformed(value):
    verdict = VALIDATOR.validate(value, VERSION)
    assert isinstance(verdict, Rejection) and verdict.reason is Reason.MALFORMED


@FUZZ
@given(
    st.sampled_from(HUGE_HEADERS),
    st.binary(max_size=64),
)
def test_bytes_declaring_huge_lengths_are_refused_without_allocating_them(header, tail):
    group, peak = peak_allocated(lambda: parse(header + tail))
    assert group is None
    assert peak < 1 << 20  # not the 4 GiB the header asks for


def test_a_group_of_many_tokens_is_refused_in_bounded_time_and_memory():
    """2.8 MiB of token ids (under the 3 MiB group cap) parse into one group: the validator refuses it on
    length before any token is decoded or scored, and the parse holds a bounded multiple of the bytes."""
    many = Completion(token_ids=[5] * 1_400_000, logprobs=[], claimed_reward=0.0)
    data = HONEST.model_copy(update={"completions": [many] * G}).to_bytes()
    assert len(data) < 3 << 20
    verdict, peak = peak_allocated(lambda: VALIDATOR.validate(parse(data), VERSION))
    assert isinstance(verdict, Rejection) and verdict.reason is Reason.TOO_LONG
    assert peak < 40 * len(data)  # Python lists of small ints: ~8 bytes a token per copy, a few copies
