"""Shared fixtures of the task tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def prompts_file(tmp_path):
    """A plug-in task's prompt rows (JSONL, with a blank line at the end): ``answer`` in every row, ``source``
    in one only."""
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "2+2=", "answer": 4},
        {"prompt": "3+5=", "answer": 8, "source": "x"},
        {"prompt": "1+0=", "answer": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path
