"""Fuzz: an inference peer's sample RPC (``SampleServicer.rpc_sample``) called directly with any request a
stranger can send. Each answer is either one refusal with a known reason and a detail, or one group per
prompt id of the version asked; no ``sample_failed`` (a bug), no hang, and the peer keeps serving."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import RolloutGroup
from echo_p2p.transport.rollouts.config import SampleServerConfig
from echo_p2p.transport.rollouts.sample import SampleError, SampleServicer
from tests.unit.fuzz.fuzzing import FUZZ, context, run
from tests.unit.transport.test_sample_servicer import HELD, TASK, Engine

pytestmark = pytest.mark.timeout(120)
LIMITS = SampleServerConfig(
    max_prompts_per_request=16, max_completions=8, max_new_tokens=64, version_grace=0.02, version_poll=0.01
)
REASONS = {e.value for e in SampleError} - {SampleError.SAMPLE_FAILED.value}
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT32 = st.integers(0, 2**32 - 1)


@pytest.fixture(scope="module")
def server():
    engine = Engine(announced={HELD}, fetchable={HELD})
    servicer = SampleServicer(
        {"count": TASK},
        engine.ensure_version,
        engine.sample,
        LIMITS,
        published_version=engine.published_version,
    )
    yield servicer
    servicer.shutdown()


@st.composite
def requests(draw) -> rollouts_pb2.SampleRequest:
    """A valid request with any of its fields replaced by what a stranger may send."""
    fields = dict(task="count", prompt_ids=[1, 2], num_completions=2, max_new_tokens=0, policy_version=HELD)
    hostile = dict(
        task=st.sampled_from(["", "chess", "count\x00"]) | st.text(max_size=300),
        prompt_ids=st.lists(st.sampled_from([0, 7, -1, TASK.num_prompts or 2**31]) | INT64, max_size=24),
        num_completions=st.sampled_from([0, 1, 8, 9]) | UINT32,
        max_new_tokens=st.sampled_from([1, 64, 65]) | UINT32,
        policy_version=st.sampled_from([HELD - 1, HELD + 1, -1]) | INT64,
        request_id=st.text(max_size=100),
    )
    for name, strategy in hostile.items():
        if draw(st.integers(0, 2)) == 0:  # each field broken one time in three
            fields[name] = draw(strategy)
    return rollouts_pb2.SampleRequest(**fields)


@settings(FUZZ, max_examples=250)
@given(requests())
def test_every_request_gets_its_groups_or_one_refusal_with_a_reason(loop, server, request):
    responses = run(loop, _collect(server.rpc_sample(request, context())))
    event(responses[0].error if responses and responses[0].error else "sampled")
    if responses and responses[0].error:
        assert len(responses) == 1 and not responses[0].group
        assert responses[0].error in REASONS, (responses[0].error, responses[0].detail)
        assert responses[0].detail and len(responses[0].detail) <= 256
        return
    groups = [RolloutGroup.from_bytes(r.group) for r in responses]
    assert [g.prompt_id for g in groups] == list(request.prompt_ids)
    assert all(g.policy_version == request.policy_version == HELD for g in groups)
    assert all(g.group_size == request.num_completions for g in groups)


async def _collect(responses):
    return [r async for r in responses]
