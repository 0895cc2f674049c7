"""How a policy version crosses into vLLM's workers (``ml.engine_vllm``), without vLLM: the batches of raw
bytes that ``collective_rpc`` carries and the worker extension that turns them back into tensors.
(The whole engine on real vLLM: ``tests/integration/test_vllm_peer.py``, in the vLLM CPU environment.)"""

from __future__ import annotations

import pickle

import pytest
import torch

from echo_p2p.ml.engine_vllm import EchoVllmWorkerExtension, VllmEngineConfig, weight_batches


class _Model:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded += list(weights)


class _Runner:
    def __init__(self) -> None:
        self.model = _Model()


class _Worker(EchoVllmWorkerExtension):
    def __init__(self) -> None:
        self.model_runner = _Runner()


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
        "lm_head.bias": torch.randn(0),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_tensor_reaches_the_worker_in_the_engines_dtype(dtype):
    weights = _weights()
    worker = _Worker()
    batches = list(weight_batches(weights, dtype, max_bytes=2**20))
    assert len(batches) == 1
    # the call's arguments survive a serialiser that knows no tensors (only bytes, str, lists)
    assert worker.echo_load_weights(pickle.loads(pickle.dumps(batches[0]))) == len(weights)
    got = dict(worker.model_runner.model.loaded)
    assert list(got) == list(weights)
    for name, tensor in weights.items():
        expected = tensor.to(getattr(torch, dtype))
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape
        assert torch.equal(got[name], expected), name


def test_an_update_is_split_into_calls_of_bounded_size():
    weights = {f"w{i}": torch.full((256,), float(i)) for i in range(10)}  # 1 KiB each in fp32
    batches = list(weight_batches(weights, "float32", max_bytes=3 * 1024))
    assert [len(b) for b in batches] == [3, 3, 3, 1]
    assert all(sum(len(item[3]) for item in b) <= 3 * 1024 for b in batches)
    big = {"big": torch.zeros(2048), "small": torch.zeros(4)}  # a tensor above the bound goes alone
    assert [[item[0] for item in b] for b in weight_batches(big, "float32", max_bytes=1024)] == [
        ["big"],
        ["small"],
    ]


def test_the_worker_refuses_a_dtype_it_does_not_know():
    with pytest.raises(ValueError, match="dtype"):
        _Worker().echo_load_weights([("w", "int64", [1], b"\0" * 8)])


def test_the_inference_section_takes_the_vllm_settings():
    from echo_p2p.config import InferenceSection

    section = InferenceSection.model_validate(
        {"engine": "vllm", "vllm": {"dtype": "bfloat16", "max_model_len": 512, "enforce_eager": True}}
    )
    assert section.vllm == VllmEngineConfig(dtype="bfloat16", max_model_len=512, enforce_eager=True)
    with pytest.raises(ValueError):
        InferenceSection.model_validate({"vllm": {"gpu_memory_utilisation": 0.5}})  # misspelt: refused


def test_an_update_carries_every_tensor_of_the_modules_vllm_fuses():
    from echo_p2p.ml.engine_vllm import whole_modules

    names = [
        "model.embed_tokens.weight",
        *(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkvo"),
        *(f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")),
        "model.layers.0.input_layernorm.weight",
        "model.norm.weight",
    ]
    changed = {"model.layers.1.self_attn.k_proj.weight": None, "model.layers.0.mlp.up_proj.weight": None}
    assert whole_modules(changed, names) == [  # in the order of the model's tensors
        *(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"),
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ]
    assert whole_modules({"model.norm.weight": None}, names) == ["model.norm.weight"]
    assert whole_modules({"model.layers.0.input_layernorm.weight": None}, names) == [
        "model.layers.0.input_layernorm.weight"
    ]


def test_a_tied_head_travels_with_the_embedding():
    from echo_p2p.ml.engine_vllm import with_tied_head

    emb = torch.ones(4, 2)
    update = {"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(2)}
    assert with_tied_head(update, tied=True)["lm_head.weight"] is emb
    assert "lm_head.weight" not in with_tied_head(update, tied=False)
    assert "lm_head.weight" not in with_tied_head({"model.norm.weight": torch.ones(2)}, tied=True)
    head = torch.zeros(4, 2)
    assert with_tied_head({**update, "lm_head.weight": head}, tied=True)["lm_head.weight"] is head


def test_a_batch_never_splits_a_module():
    """vLLM reloads each batch as one update, and a layer given part of its tensors gets garbage in the
    rest (SmolLM2's 64 MiB batches did that: mean |log-prob error| 0.3 after an update, 0 now)."""
    attn = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(3) for p in "qkvo"]
    weights = {name: torch.zeros(256) for name in attn}  # 1 KiB each, 4 KiB per module
    batches = [[item[0] for item in b] for b in weight_batches(weights, "float32", max_bytes=6 * 1024)]
    assert [len(b) for b in batches] == [4, 4, 4]
    assert all(len({name.rsplit(".", 2)[0] for name in b}) == 1 for b in batches)
