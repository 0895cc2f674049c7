"""Trainer checkpoints: policy weights, optimizer state, policy version and counters, written atomically.

Owned here: ``CheckpointConfig`` (where, how often, how many to keep), ``CheckpointManager`` (``save``,
``latest``, ``load``, ``due``), the on-disk layout and the rules that make a restart safe:

- **Atomic**: a checkpoint is written into a hidden temporary directory, every file and the directory are
  fsync'ed, ``meta.json`` (sizes and sha256 of every file) is written last, and only then is the directory
  renamed to its final name (and the parent fsync'ed). A crash leaves either the previous checkpoints
  untouched or a temporary directory that is ignored and removed by the next save.
- **Torn checkpoints are skipped**: a final-named directory without a readable ``meta.json``, or whose
  files do not match it (size in ``latest``, size and sha256 in ``load``), is not a checkpoint;
  ``latest``/``load`` fall back to the previous complete one.
- **Versions never go backwards**: ``save`` refuses a version lower than the newest complete checkpoint's;
  the same version may be saved again (e.g. on shutdown right after a periodic save).

Layout: ``<dir>/ckpt-<seq:08d>-v<version:012d>/{model.safetensors, optimizer.pt, meta.json}`` plus the small
files a caller attaches (``files``: the trainer writes the model's ``config.json``, ``generation_config.json``
and tokenizer files, so that a checkpoint describes its model and ``python -m echo_p2p.export`` needs no
``--model``; they are listed in ``meta.json`` with their digests like the rest); ``seq`` grows
by one per save, so checkpoints of the same version are ordered too. Model weights are safetensors (no
code execution on load, tied weights stored once per name); the optimizer state is ``torch.save``'d and read
back with ``weights_only=True``; ``extra`` (buffer counters, rng seeds...) must be JSON-serialisable.
Called by the trainer peer (every ``save_every`` versions and on shutdown; ``--resume`` loads the latest)
and by tests. Pure: no hivemind, no network. One writer per directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from echo_p2p.paths import UserPath, expand_path

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"
_NAME_RE = re.compile(r"^ckpt-(\d{8})-v(\d{12})$")
_TMP_PREFIX = ".tmp-ckpt-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (the message says which and why)."""


class CheckpointVersionError(CheckpointError, ValueError):
    """Refused to save a version lower than the newest checkpoint on disk (versions never go backwards)."""


class CheckpointConfig(BaseModel):
    """Where and how often a trainer writes checkpoints."""

    model_config = ConfigDict(extra="forbid")

    directory: UserPath = Field(description="Directory of this trainer's checkpoints (created when missing).")
    save_every: int | None = Field(
        default=10,
        ge=1,
        description="Write a checkpoint every this many policy versions (and always on shutdown); None: "
        "only on shutdown.",
    )
    keep_last: int = Field(default=2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    resume: bool = Field(
        default=False, description="Start from the newest complete checkpoint in `directory` (``--resume``)."
    )


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk (what ``meta.json`` says about it)."""

    path: Path
    seq: int
    version: int
    created: float
    extra: dict[str, Any]
    files: dict[str, dict[str, Any]]  # file name -> {"size": int, "sha256": str}

    @property
    def has_optimizer_state(self) -> bool:
        return OPTIMIZER_FILE in self.files

    def read_file(self, name: str) -> bytes:
        """The bytes of one of this checkpoint's files, checked against its sha256 in ``meta.json``
        (``CheckpointError`` when it is not listed, unreadable or corrupt)."""
        if name not in self.files:
            raise CheckpointError(f"{self.path.name} has no file {name!r}")
        return _verified_bytes(self, name)


@dataclass
class LoadedCheckpoint:
    """The contents of a checkpoint, verified against its digests."""

    version: int
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


class CheckpointManager:
    """Saves and finds checkpoints in one directory; see the module docstring for the guarantees."""

    def __init__(self, directory: str | os.PathLike, keep_last: int = 2, save_every: int | None = None):
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if save_every is not None and save_every < 1:
            raise ValueError("save_every must be >= 1 or None")
        self.directory = Path(expand_path(str(directory)))
        self.keep_last = keep_last
        self.save_every = save_every
        self._last_saved_version: int | None = None

    @classmethod
    def from_config(cls, config: CheckpointConfig) -> CheckpointManager:
        return cls(config.directory, keep_last=config.keep_last, save_every=config.save_every)

    # ------------------------------------------------------------------------------------------- reading

    def list(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first (torn or temporary directories are left out)."""
        out = []
        for path, _seq, _version in self._named_dirs():
            ckpt = _read_meta(path)
            if ckpt is not None:
                out.append(ckpt)
        out.sort(key=lambda c: (c.version, c.seq))
        return out

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint (highest version, then latest saved), or None."""
        ckpts = self.list()
        return ckpts[-1] if ckpts else None

    def load(
        self, checkpoint: Checkpoint | None = None, map_location: str | torch.device = "cpu"
    ) -> LoadedCheckpoint:
        """Read ``checkpoint`` (default: the newest complete one), verifying every file's sha256.

        Without an explicit checkpoint, one that fails verification is skipped with a warning and the
        previous one is tried. Raises ``FileNotFoundError`` when there is no usable checkpoint, and
        ``CheckpointError`` when an explicitly given one is corrupt.
        """
        if checkpoint is not None:
            return _load(checkpoint, map_location)
        for ckpt in reversed(self.list()):
            try:
                return _load(ckpt, map_location)
            except CheckpointError as exc:
                logger.warning("skipping corrupt checkpoint %s: %s", ckpt.path.name, exc)
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}")

    # ------------------------------------------------------------------------------------------- writing

    def due(self, version: int) -> bool:
        """True when a periodic checkpoint should be written at ``version``: ``save_every`` versions or more
        since the last one this manager saved (or found on disk)."""
        if self.save_every is None:
            return False
        last = self._last_saved_version
        if last is None:
            latest = self.latest()
            last = latest.version if latest is not None else 0
            self._last_saved_version = last
        return version >= last + self.save_every

    def save(
        self,
        version: int,
        model_state: Mapping[str, torch.Tensor],
        optimizer_state: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> Checkpoint:
        """Write a checkpoint of ``version`` atomically and prune old ones; returns it.

        ``files``: more files to write into the checkpoint, by plain file name (e.g. the model's config and
        tokenizer files), each listed in ``meta.json`` with its size and sha256.
        Raises ``CheckpointVersionError`` if ``version`` is lower than the newest complete checkpoint's,
        ``TypeError`` if ``extra`` is not JSON-serialisable, ``ValueError`` for a file name that is not a
        plain name or is one of the checkpoint's own (nothing is written then).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        extra_json = json.loads(json.dumps(dict(extra or {})))  # fails early on non-JSON values
        attached = dict(files or {})
        for name in attached:
            if (
                name in (MODEL_FILE, OPTIMIZER_FILE, META_FILE, "", ".", "..")
                or os.path.basename(name) != name
            ):
                raise ValueError(f"cannot attach a file named {name!r} to a checkpoint")
        latest = self.latest()
        if latest is not None and version < latest.version:
            raise CheckpointVersionError(
                f"refusing to save version {version}: {self.directory} already holds version "
                f"{latest.version} ({latest.path.name}); versions never go backwards"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_temporaries()
        seq = max((s for _, s, _ in self._named_dirs()), default=0) + 1
        final = self.directory / f"ckpt-{seq:08d}-v{version:012d}"
        tmp = self.directory / f"{_TMP_PREFIX}{seq:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files = {MODEL_FILE: _write_model(tmp / MODEL_FILE, model_state)}
            if optimizer_state is not None:
                files[OPTIMIZER_FILE] = _write_torch(tmp / OPTIMIZER_FILE, dict(optimizer_state))
            for name, data in attached.items():
                files[name] = _write_bytes(tmp / name, bytes(data))
            meta = {
                "format": FORMAT_VERSION,
                "seq": seq,
                "version": version,
                "created": time.time(),
                "files": files,
                "extra": extra_json,
            }
            _write_bytes(tmp / META_FILE, json.dumps(meta, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._last_saved_version = version
        self._prune(keep=final)
        ckpt = _read_meta(final)
        if ckpt is None:  # pragma: no cover - we just wrote it
            raise CheckpointError(f"checkpoint {final} unreadable right after writing it")
        logger.info("checkpoint %s written (version %d)", final.name, version)
        return ckpt

    # ------------------------------------------------------------------------------------------- helpers

    def _named_dirs(self) -> list[tuple[Path, int, int]]:
        if not self.directory.is_dir():
            return []
        out = []
        for path in self.directory.iterdir():
            m = _NAME_RE.match(path.name)
            if m and path.is_dir():
                out.append((path, int(m.group(1)), int(m.group(2))))
        return out

    def _remove_temporaries(self) -> None:
        for path in self.directory.iterdir():
            if path.name.startswith(_TMP_PREFIX) and path.is_dir():
                logger.info("removing unfinished checkpoint %s (a crash during a save)", path.name)
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; remove older ones and torn directories."""
        complete = self.list()
        kept = {c.path for c in complete[-self.keep_last :]} | {keep}
        newest_seq = max(c.seq for c in complete) if complete else 0
        complete_paths = {c.path for c in complete}
        for path, seq, _ in self._named_dirs():
            torn = path not in complete_paths
            if path in kept or (torn and seq > newest_seq):
                continue
            shutil.rmtree(path, ignore_errors=True)
        _fsync_dir(self.directory)


# ----------------------------------------------------------------------------------------------- files


def _write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _file_info(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _write_model(path: Path, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"model_state[{name!r}] is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()  # tied weights or a view: safetensors wants one whole, unshared storage per name
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, str(path))
    return _file_info(path)


def _write_torch(path: Path, obj: Any) -> dict[str, Any]:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return _file_info(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _read_meta(path: Path) -> Checkpoint | None:
    """The checkpoint in ``path`` if its meta.json is complete and every file has the recorded size."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        m = _NAME_RE.match(path.name)
        if not m or meta.get("format") != FORMAT_VERSION:
            return None
        seq, version = int(meta["seq"]), int(meta["version"])
        if (seq, version) != (int(m.group(1)), int(m.group(2))):
            return None
        files = dict(meta["files"])
        if MODEL_FILE not in files:
            return None
        for name, info in files.items():
            if (path / name).stat().st_size != int(info["size"]):
                return None
        return Checkpoint(
            path=path,
            seq=seq,
            version=version,
            created=float(meta["created"]),
            extra=dict(meta.get("extra") or {}),
            files=files,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _verified_bytes(ckpt: Checkpoint, name: str) -> bytes:
    try:
        data = (ckpt.path / name).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{ckpt.path.name}/{name}: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != ckpt.files[name]["sha256"]:
        raise CheckpointError(f"{ckpt.path.name}/{name}: sha256 does not match meta.json (corrupt file)")
    return data


def _load(ckpt: Checkpoint, map_location: str | torch.device) -> LoadedCheckpoint:
    import io

    from safetensors.torch import load

    try:
        model_state = load(_verified_bytes(ckpt, MODEL_FILE))
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{ckpt.path.name}/{MODEL_FILE}: unreadable ({exc})") from None
    if str(map_location) != "cpu":
        model_state = {k: v.to(map_location) for k, v in model_state.items()}
    optimizer_state = None
    if ckpt.has_optimizer_state:
        data = _verified_bytes(ckpt, OPTIMIZER_FILE)
        try:
            optimizer_state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{ckpt.path.name}/{OPTIMIZER_FILE}: unreadable ({exc})") from None
    return LoadedCheckpoint(
        version=ckpt.version,
        model_state=model_state,
        optimizer_state=optimizer_state,
        extra=dict(ckpt.extra),
        path=ckpt.path,
    )
