"""Sync mode: nobody can hold an inference peer's sampling slot by asking for a version that was never
published, waiting for a version blocks no other requester, and each requester has one request at a time.
``SampleServicer.rpc_sample`` called directly (fake context, fake engine); every wait has a deadline."""

from __future__ import annotations

import asyncio
import threading

import pytest
from hivemind.p2p import P2PContext, PeerID

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import Completion, RolloutGroup
from echo_p2p.tasks.registry import build_task
from echo_p2p.transport.rollouts.config import SampleServerConfig
from echo_p2p.transport.rollouts.sample import SampleServicer

TASK = build_task("count")
HELD = 3
A, B, C = (PeerID(b"\x12\x20" + bytes([i]) * 32) for i in (1, 2, 3))


class Engine:
    """An inference peer stand-in: what trusted trainers announce, what it holds, sampling on demand."""

    def __init__(self, announced: set[int], fetchable: set[int]):
        self.announced, self.fetchable = set(announced), set(fetchable)
        self.reads = 0
        self.fetched: list[int] = []
        self.fetch_gate: dict[int, threading.Event] = {}  # version -> released when its fetch may end
        self.sample_gate: threading.Event | None = None  # set: sampling waits for it
        self.sampling = threading.Event()

    def published_version(self) -> int | None:
        self.reads += 1
        return max(self.announced, default=None)

    def ensure_version(self, version: int) -> bool:
        self.fetched.append(version)
        gate = self.fetch_gate.get(version)
        if gate is not None:
            gate.wait(20)
        return version in self.fetchable

    def sample(self, task: str, prompt_ids: list[int], n: int, version: int, max_new_tokens: int):
        self.sampling.set()
        if self.sample_gate is not None:
            self.sample_gate.wait(20)
        completion = Completion(token_ids=[1], logprobs=[-0.1], claimed_reward=0.0)
        return [
            RolloutGroup(
                task=task,
                prompt_id=p,
                prompt_token_ids=[1],
                completions=[completion] * n,
                policy_version=version,
            )
            for p in prompt_ids
        ]


def servicer(engine: Engine, **config) -> SampleServicer:
    limits = SampleServerConfig(**{"version_grace": 30.0, "version_poll": 0.05, **config})
    return SampleServicer(
        {"count": TASK},
        engine.ensure_version,
        engine.sample,
        limits,
        published_version=engine.published_version,
    )


async def ask(
    s: SampleServicer, who: PeerID, version: int = HELD, prompt_ids=(1, 2)
) -> list[rollouts_pb2.SampleResponse]:
    request = rollouts_pb2.SampleRequest(
        task="count", prompt_ids=list(prompt_ids), num_completions=2, policy_version=version
    )
    context = P2PContext(handle_name="test", local_id=C, remote_id=who)
    return [r async for r in s.rpc_sample(request, context)]


def groups_of(responses) -> list[int]:
    assert all(not r.error for r in responses), [(r.error, r.detail) for r in responses]
    return [RolloutGroup.from_bytes(r.group).prompt_id for r in responses]


def error_of(responses) -> tuple[str, str]:
    assert len(responses) == 1 and responses[0].error, responses
    return responses[0].error, responses[0].detail


@pytest.fixture
def cleanup():
    servicers: list[SampleServicer] = []
    yield servicers.append
    for s in servicers:
        s.shutdown()


async def test_a_request_for_a_version_nobody_announced_holds_no_sampling_slot(cleanup):
    engine = Engine(announced={HELD}, fetchable={HELD})
    s = servicer(engine)  # one sampling slot
    cleanup(s)
    hog = asyncio.create_task(ask(s, A, version=10**9))  # waits up to version_grace (30 s) for it
    assert groups_of(await asyncio.wait_for(ask(s, B), 10)) == [1, 2]  # sampled meanwhile
    assert not hog.done() and engine.fetched == [HELD]  # never fetched: nobody announced it
    engine.announced.add(10**9)  # announced, but no trusted trainer's manifest for it (not fetchable)
    assert error_of(await asyncio.wait_for(hog, 10))[0] == "unknown_version"


async def test_an_unannounced_version_is_refused_after_the_grace_with_one_shared_read_per_poll(cleanup):
    engine = Engine(announced={HELD}, fetchable={HELD})
    s = servicer(engine, version_grace=0.3, version_poll=0.1, max_waiting=8)
    cleanup(s)
    requesters = [PeerID(b"\x12\x20" + bytes([10 + i]) * 32) for i in range(5)]
    answers = await asyncio.wait_for(asyncio.gather(*(ask(s, p, version=HELD + 1) for p in requesters)), 10)
    for responses in answers:
        reason, detail = error_of(responses)
        assert reason == "unknown_version" and f"version {HELD + 1}" in detail
    assert engine.fetched == []
    assert engine.reads <= 0.3 / 0.1 + 2  # shared by the five: not one read per request per poll
    assert s.stats()["rejected"] == {"unknown_version": 5}


async def test_a_version_announced_during_the_grace_is_fetched_and_sampled(cleanup):
    engine = Engine(announced={HELD}, fetchable={HELD, HELD + 1})
    s = servicer(engine)
    cleanup(s)
    pending = asyncio.create_task(ask(s, A, version=HELD + 1))
    for _ in range(200):  # until it has read the records once (deadline: 200 x 0.05 s)
        if engine.reads:
            break
        await asyncio.sleep(0.05)
    engine.announced.add(HELD + 1)  # the trainer's record arrives
    assert groups_of(await asyncio.wait_for(pending, 10)) == [1, 2]
    assert engine.fetched == [HELD + 1]


async def test_fetching_a_version_does_not_block_a_requester_whose_version_is_held(cleanup):
    engine = Engine(announced={HELD, HELD + 1}, fetchable={HELD, HELD + 1})
    engine.fetch_gate[HELD + 1] = gate = threading.Event()  # a slow fetch of the newer version
    s = servicer(engine)
    cleanup(s)
    slow = asyncio.create_task(ask(s, A, version=HELD + 1))
    try:
        assert groups_of(await asyncio.wait_for(ask(s, B, version=HELD), 10)) == [1, 2]
        assert not slow.done()
    finally:
        gate.set()
    assert groups_of(await asyncio.wait_for(slow, 10)) == [1, 2]


async def test_one_request_at_a_time_per_requester_and_a_bounded_number_in_all(cleanup):
    engine = Engine(announced={HELD}, fetchable={HELD})
    engine.sample_gate = gate = threading.Event()
    s = servicer(engine, max_concurrent=1, max_waiting=1)
    cleanup(s)
    first = asyncio.create_task(ask(s, A))
    await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, engine.sampling.wait, 10), 15)
    try:
        reason, detail = error_of(await asyncio.wait_for(ask(s, A), 10))  # A again, while its first runs
        assert reason == "busy" and "per requester" in detail
        waiting = asyncio.create_task(ask(s, B))  # another requester waits for the slot
        for _ in range(200):
            if s._active == 2:
                break
            await asyncio.sleep(0.05)
        reason, detail = error_of(await asyncio.wait_for(ask(s, C), 10))  # 1 sampling + 1 waiting: full
        assert reason == "busy" and "in progress" in detail
    finally:
        gate.set()
    assert groups_of(await asyncio.wait_for(first, 10)) == [1, 2]
    assert groups_of(await asyncio.wait_for(waiting, 10)) == [1, 2]
    assert groups_of(await asyncio.wait_for(ask(s, A), 10)) == [1, 2]  # its turn again once done
    assert s.stats()["rejected"] == {"busy": 2}


async def test_a_version_announced_just_before_it_is_asked_for_is_served_without_waiting_a_poll(cleanup):
    """Sync mode: a trainer publishes version v, then asks for it; the request's first look reads the
    records at once instead of waiting out the shared read's poll period (30 s here), and a request for a
    version already seen announced reads nothing."""
    engine = Engine(announced={HELD}, fetchable={HELD, HELD + 1})
    s = servicer(engine, version_poll=30.0)
    cleanup(s)
    assert groups_of(await asyncio.wait_for(ask(s, A), 10)) == [1, 2]
    assert engine.reads == 1
    engine.announced.add(HELD + 1)  # published an instant before the request
    assert groups_of(await asyncio.wait_for(ask(s, A, version=HELD + 1), 10)) == [1, 2]
    assert engine.reads == 2 and engine.fetched == [HELD, HELD + 1]
    assert groups_of(await asyncio.wait_for(ask(s, B, version=HELD), 10)) == [1, 2]
    assert engine.reads == 2  # version 3 is known to be announced: no read


async def test_a_request_naming_a_held_out_prompt_is_refused(cleanup):
    """Held-out prompts are for evaluation: a sampler does not sample them for a trainer either."""
    engine = Engine(announced={HELD}, fetchable={HELD})
    s = servicer(engine)
    cleanup(s)
    held = TASK.held_out_ids()[0]
    error, detail = error_of(await asyncio.wait_for(ask(s, A, prompt_ids=(1, held)), 10))
    assert error == "bad_prompt_id" and "held out" in detail
    assert groups_of(await asyncio.wait_for(ask(s, A), 10)) == [1, 2]
