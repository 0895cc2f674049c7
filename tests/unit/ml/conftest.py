"""Fixtures of the ML tests: one thread (shared 2-core machines) and the tiny preset built once."""

from __future__ import annotations

import pytest
import torch

from echo_p2p.ml.models import ModelSpec, load_policy


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny preset, seed 0, fp32 on CPU. Tests must not modify it."""
    torch.set_num_threads(1)
    return load_policy(ModelSpec(preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tiny):
    """The tiny preset saved with save_pretrained: loads through the real from_pretrained path."""
    from echo_p2p.ml.models import save_policy

    return save_policy(*tiny, tmp_path_factory.mktemp("tiny_policy"))
