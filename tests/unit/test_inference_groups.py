"""What an inference peer writes into each group about the weights that sampled it: the version and the
publisher stream of the weights it held when sampling (``RolloutGroup.weights_stream``), so a trainer replays
its draws only under weights it knows to be those."""

from __future__ import annotations

import torch

from echo_p2p.ml.engine import Sample
from echo_p2p.ml.tokenizer import build_char_tokenizer
from echo_p2p.roles.inference import InferencePeer
from echo_p2p.tasks.registry import build_task
from echo_p2p.weights.model_io import PolicyWeights
from tests.unit.conftest import unstarted_peer


class FakeEngine:
    """Holds what it was loaded with; samples ``n`` copies of one completion per prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.loads = 0

    def load_weights(self, tensors):
        self.loads += 1

    def sample(self, prompts, n, params):
        eos = self.tokenizer.eos_token_id
        return [
            [Sample(token_ids=[eos], logprobs=[-0.5], finished=True, seed="ab" * 16)] * n for _ in prompts
        ]


def test_each_group_names_the_version_and_the_publisher_stream_of_the_weights_that_sampled_it():
    peer = unstarted_peer(InferencePeer)
    peer.tokenizer = build_char_tokenizer()
    peer.engine = FakeEngine(peer.tokenizer)
    peer.task = build_task("count", {})
    peer.params = peer.config.run.sampling_params(peer.task.max_new_tokens)
    peer._load(PolicyWeights(version=3, stream_id="5eed5eed5eed5eed", tensors={"w": torch.zeros(1)}))
    first = peer._sample([0, 1], 2)
    assert [(g.policy_version, g.weights_stream) for g in first] == [(3, "5eed5eed5eed5eed")] * 2
    # another publisher's stream (a trainer that took over): the next groups say so
    peer._load(PolicyWeights(version=4, stream_id="0ther0ther0ther0", tensors={"w": torch.zeros(1)}))
    second = peer._sample([2], 2)
    assert (second[0].policy_version, second[0].weights_stream) == (4, "0ther0ther0ther0")
    assert peer.engine.loads == 2
    assert (
        type(second[0]).from_bytes(second[0].to_bytes()).weights_stream == "0ther0ther0ther0"
    )  # on the wire
