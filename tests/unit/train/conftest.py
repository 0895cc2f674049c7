"""The GRPO tests run torch on one thread (two test workers share the cores); their model and group
fixtures are shared with the guard's tests (``tests/unit/conftest.py``)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)
