"""CheckpointManager: atomic saves, newest-complete lookup, torn checkpoints skipped, versions never go back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from echo_p2p.train.checkpoint import (
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointVersionError,
)


def _model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, like a causal LM's embeddings and lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    return model, opt


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_roundtrip_restores_model_optimizer_version_and_extra(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path / "ckpt")
    saved = mgr.save(7, model.state_dict(), opt.state_dict(), {"buffer": {"added": 12, "dropped": 3}})
    assert saved.version == 7 and saved.has_optimizer_state

    fresh, fresh_opt = _model_and_optimizer(seed=1)
    loaded = mgr.load()
    assert loaded.version == 7 and loaded.extra == {"buffer": {"added": 12, "dropped": 3}}
    fresh.load_state_dict(loaded.model_state)
    fresh_opt.load_state_dict(loaded.optimizer_state)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert fresh[1].weight is fresh[0].weight  # still tied after loading
    ref = opt.state_dict()["state"][0]
    got = fresh_opt.state_dict()["state"][0]
    assert torch.equal(ref["exp_avg"], got["exp_avg"]) and int(ref["step"]) == int(got["step"])


def test_latest_is_newest_and_old_ones_are_pruned(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None
    for version in (1, 2, 5, 5):
        mgr.save(version, model.state_dict(), opt.state_dict(), {"v": version})
    ckpts = mgr.list()
    assert [c.version for c in ckpts] == [5, 5]  # keep_last=2; saving the same version again is allowed
    assert mgr.latest() == ckpts[-1] and ckpts[-1].seq > ckpts[0].seq
    assert len(_dirs(tmp_path)) == 2  # nothing but the two checkpoints is left


def test_refuses_to_save_a_lower_version(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    mgr.save(10, model.state_dict())
    with pytest.raises(CheckpointVersionError, match="never go backwards"):
        mgr.save(9, model.state_dict())
    # a new manager on the same directory (a restarted trainer) refuses too
    with pytest.raises(CheckpointVersionError):
        CheckpointManager(tmp_path).save(3, model.state_dict())
    assert mgr.latest().version == 10
    assert mgr.load().optimizer_state is None  # saved without optimizer state


def test_crash_during_save_leaves_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    mgr.save(3, model.state_dict(), opt.state_dict())

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(4, model.state_dict(), opt.state_dict())
    monkeypatch.undo()
    assert mgr.latest().version == 3
    assert len(_dirs(tmp_path)) == 1  # the unfinished temporary directory was removed


def test_torn_checkpoints_are_ignored_in_favour_of_the_previous_complete_one(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path, keep_last=5)
    good = mgr.save(2, model.state_dict(), opt.state_dict(), {"n": 2})

    # crash before the rename: a temporary directory with files but no meta
    tmp = tmp_path / ".tmp-ckpt-00000009-deadbeef"
    tmp.mkdir()
    (tmp / MODEL_FILE).write_bytes(b"partial")
    # a final-named directory without meta.json (e.g. copied by hand, or a filesystem that lost it)
    no_meta = tmp_path / "ckpt-00000010-v000000000003"
    no_meta.mkdir()
    (no_meta / MODEL_FILE).write_bytes((good.path / MODEL_FILE).read_bytes())
    # a final-named directory whose model file was truncated after the fact
    truncated = mgr.save(4, model.state_dict(), opt.state_dict())
    data = (truncated.path / MODEL_FILE).read_bytes()
    (truncated.path / MODEL_FILE).write_bytes(data[: len(data) // 2])

    latest = mgr.latest()
    assert latest is not None and latest.version == 2 and latest.path == good.path
    assert mgr.load().extra == {"n": 2}
    # the torn ones do not block a lower version than theirs either: only complete checkpoints count
    mgr.save(3, model.state_dict())
    assert mgr.latest().version == 3
    assert not tmp.exists() and not no_meta.exists() and not truncated.path.exists()


def test_same_size_corruption_is_caught_by_the_digest_and_skipped(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, model.state_dict(), opt.state_dict(), {"n": 1})
    bad = mgr.save(2, model.state_dict(), opt.state_dict(), {"n": 2})
    path = bad.path / OPTIMIZER_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    assert mgr.latest().version == 2  # sizes match: only a full read can tell
    with pytest.raises(CheckpointError, match="sha256"):
        mgr.load(bad)
    assert mgr.load().extra == {"n": 1}  # falls back to the previous complete checkpoint


def test_meta_is_written_last_and_names_every_file(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer()
    ckpt = CheckpointManager(tmp_path).save(0, model.state_dict(), opt.state_dict())
    meta = json.loads((ckpt.path / META_FILE).read_text())
    assert set(meta["files"]) == {MODEL_FILE, OPTIMIZER_FILE} and meta["version"] == 0
    assert ckpt.path.name == "ckpt-00000001-v000000000000"


def test_bad_inputs_write_nothing(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path / "c")
    with pytest.raises(TypeError):
        mgr.save(1, model.state_dict(), extra={"x": object()})
    with pytest.raises(ValueError):
        mgr.save(-1, model.state_dict())
    assert mgr.latest() is None
    with pytest.raises(FileNotFoundError):
        mgr.load()


def test_due_every_n_versions_counts_from_the_last_checkpoint_on_disk(tmp_path: Path) -> None:
    model, _ = _model_and_optimizer()
    CheckpointManager(tmp_path).save(20, model.state_dict())
    mgr = CheckpointManager.from_config(CheckpointConfig(directory=str(tmp_path), save_every=5))
    assert not mgr.due(21) and not mgr.due(24) and mgr.due(25)
    mgr.save(25, model.state_dict())
    assert not mgr.due(29) and mgr.due(30)
    assert not CheckpointManager(tmp_path, save_every=None).due(10_000)


def test_attached_files_are_listed_verified_and_plain_named(tmp_path: Path) -> None:
    """Files attached to a checkpoint (the trainer's model config and tokenizer) are in meta.json with their
    digests, read back verified, and must be plain names that are not the checkpoint's own files."""
    model, opt = _model_and_optimizer()
    mgr = CheckpointManager(tmp_path)
    ckpt = mgr.save(2, model.state_dict(), opt.state_dict(), files={"config.json": b'{"a": 1}'})
    assert ckpt.read_file("config.json") == b'{"a": 1}' and "config.json" in ckpt.files
    assert mgr.load().version == 2
    (ckpt.path / "config.json").write_bytes(b'{"a": 2}')
    with pytest.raises(CheckpointError, match="sha256"):
        ckpt.read_file("config.json")
    with pytest.raises(CheckpointError, match="no file"):
        ckpt.read_file("tokenizer.json")
    for bad in (META_FILE, MODEL_FILE, "../x.json", "sub/x.json", ""):
        with pytest.raises(ValueError, match="cannot attach"):
            mgr.save(3, model.state_dict(), files={bad: b"x"})
    assert mgr.latest().version == 2  # nothing written by the refused saves
