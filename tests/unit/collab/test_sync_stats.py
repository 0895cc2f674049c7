"""Every counter ``SyncedOptimizer`` increments exists from the start: ``advance_to`` (a trainer going on
alone after its donor died) incremented ``sync_stats["advanced"]``, which was never created, so the one
trainer left in a run crashed with ``KeyError: 'advanced'`` (seen in a fresh-clone run, 2026-12-02)."""

from __future__ import annotations

import ast
from pathlib import Path

import echo_p2p.collab.sync as sync


def test_every_sync_counter_incremented_is_created_with_the_optimizer():
    tree = ast.parse(Path(sync.__file__).read_text())
    created: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "sync_stats" for t in node.targets
        ):
            assert isinstance(node.value, ast.Call)
            if ast.unparse(node.value) == "dict.fromkeys(SYNC_STATS, 0)":  # the counters' one list
                created |= set(sync.SYNC_STATS)
            else:
                created |= {kw.arg for kw in node.value.keywords}
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
            if node.value.attr == "sync_stats":
                if isinstance(node.slice, ast.Constant):
                    used.add(node.slice.value)
                elif isinstance(node.slice, ast.IfExp):  # "a" if cond else "b"
                    used |= {node.slice.body.value, node.slice.orelse.value}
    assert "advanced" in used and used <= created, used - created
