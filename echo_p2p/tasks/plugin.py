"""User tasks: a reward function named by import path and prompts from a local file.

Owned here: ``load_reward_function("module:function" | "path/to/file.py:function")`` and ``PluginTask``.
The reward function has TRL's GRPO signature ``f(prompts, completions, **kwargs) -> list[float]``; the
prompts come from a JSONL file (one ``{"prompt": "...", ...}`` object per line) or a dataset saved with
``datasets.save_to_disk`` (only when the ``datasets`` package is installed: it is not a dependency). Every
other column is passed to the reward function as a keyword argument holding one value per completion, as TRL
does. Called through the registry (task name ``plugin``).
Must not import torch. A reward function that raises or returns garbage must not crash a peer: the batch
scores 0 and the error is logged. Rewards outside [0, 1] are clipped into it (logged once).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from echo_p2p.tasks.base import Task, TaskError, TaskOptions, clamp01

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., Sequence[float | None]]


class PluginError(TaskError):
    """A plug-in reward function or prompt file could not be loaded."""


def load_reward_function(spec: str) -> RewardFunction:
    """Import ``spec`` = ``"package.module:function"`` (importable module) or ``"path/to/file.py:function"``
    (a Python file, loaded under a private module name) and return the function; ``PluginError`` otherwise."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PluginError(
            f"reward function {spec!r} must look like 'package.module:function' or 'file.py:function'"
        )
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr.isidentifier():
        raise PluginError(
            f"reward function {spec!r} must look like 'package.module:function' or 'file.py:function'"
        )
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise PluginError(f"reward module file not found: {path}")
        name = f"echo_p2p_reward_plugin_{abs(hash(str(path.resolve())))}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise PluginError(f"cannot import {path} as a Python module")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        try:
            mod_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise PluginError(f"importing reward module {path} failed: {exc!r}") from exc
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise PluginError(f"cannot import reward module {module_part!r}: {exc}") from exc
        except Exception as exc:
            raise PluginError(f"importing reward module {module_part!r} failed: {exc!r}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise PluginError(f"module {module_part!r} has no attribute {attr!r}")
    if not callable(fn):
        raise PluginError(f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _check_signature(fn: RewardFunction, spec: str, columns: Sequence[str]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: accept, errors surface when called
        return
    try:
        sig.bind(prompts=[], completions=[], **{c: [] for c in columns})
    except TypeError as exc:
        raise PluginError(
            f"reward function {spec!r} must accept (prompts, completions, **kwargs) like a TRL reward "
            f"function (extra columns: {list(columns)}): {exc}"
        ) from exc


def load_prompt_rows(
    path: str, prompt_column: str = "prompt", split: str | None = None
) -> list[dict[str, Any]]:
    """Rows of a JSONL file or of a ``datasets.save_to_disk`` directory; each must have a string
    ``prompt_column``."""
    source = Path(path).expanduser()
    if source.is_dir():
        rows = _load_dataset_dir(source, split)
    elif source.is_file():
        rows = []
        with source.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PluginError(f"{source}:{lineno}: not valid JSON ({exc.msg})") from exc
                if not isinstance(row, dict):
                    raise PluginError(f"{source}:{lineno}: each line must be a JSON object")
                rows.append(row)
    else:
        raise PluginError(f"prompts not found: {source} (a .jsonl file or a datasets.save_to_disk directory)")
    if not rows:
        raise PluginError(f"no prompts in {source}")
    for i, row in enumerate(rows):
        if not isinstance(row.get(prompt_column), str):
            raise PluginError(f"{source}: row {i} has no string {prompt_column!r} column (only text prompts)")
    return rows


def _load_dataset_dir(source: Path, split: str | None) -> list[dict[str, Any]]:
    if importlib.util.find_spec("datasets") is None:
        raise PluginError(
            f"{source} is a directory: loading a dataset saved with save_to_disk needs the `datasets` "
            "package, which is not installed (pip install datasets), or convert it to a .jsonl file"
        )
    import datasets

    try:
        ds = datasets.load_from_disk(str(source))
    except Exception as exc:
        raise PluginError(f"cannot load a dataset from {source}: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds.keys())
        chosen = split or ("train" if "train" in ds else names[0] if len(names) == 1 else None)
        if chosen is None or chosen not in ds:
            raise PluginError(f"{source} holds splits {names}: choose one with the 'split' option")
        ds = ds[chosen]
    return [dict(row) for row in ds]


class PluginOptions(TaskOptions):
    reward: str = Field(
        description="Reward function: 'package.module:function' or 'path/to/file.py:function'"
    )
    prompts: str = Field(description="A .jsonl file or a datasets.save_to_disk directory")
    prompt_column: str = Field(default="prompt", description="Column holding the prompt text")
    split: str | None = Field(default=None, description="Split of a saved DatasetDict (default: 'train')")
    max_new_tokens: int = Field(default=64, ge=1, description="Completion cap")


class PluginTask(Task):
    """Prompts from a file (id = row index), rewards from a user function with TRL's GRPO signature."""

    name = "plugin"

    def __init__(self, options: PluginOptions) -> None:
        self.options = options
        self.max_new_tokens = options.max_new_tokens
        self.reward_fn = load_reward_function(options.reward)
        self.rows = load_prompt_rows(options.prompts, options.prompt_column, options.split)
        self.columns = sorted({k for row in self.rows for k in row} - {options.prompt_column})
        _check_signature(self.reward_fn, options.reward, self.columns)
        self._warned_range = False

    @property
    def num_prompts(self) -> int:
        return len(self.rows)

    def prompt(self, prompt_id: int) -> str:
        return self.rows[self.check_prompt_id(prompt_id)][self.options.prompt_column]

    def score(self, prompt_id: int, completion_text: str) -> float:
        return self.score_batch([prompt_id], [completion_text])[0]

    def score_batch(self, prompt_ids: Sequence[int], completion_texts: Sequence[str]) -> list[float]:
        if len(prompt_ids) != len(completion_texts):
            raise TaskError(f"{len(prompt_ids)} prompt ids for {len(completion_texts)} completions")
        if not prompt_ids:
            return []
        rows = [self.rows[self.check_prompt_id(p)] for p in prompt_ids]
        kwargs = {c: [row.get(c) for row in rows] for c in self.columns}
        prompts = [row[self.options.prompt_column] for row in rows]
        try:
            raw = self.reward_fn(prompts=prompts, completions=list(completion_texts), **kwargs)
            values = list(raw)
            if len(values) != len(prompts):
                raise ValueError(f"returned {len(values)} rewards for {len(prompts)} completions")
        except Exception:
            logger.exception("reward function %s failed: scoring this batch 0", self.options.reward)
            return [0.0] * len(prompts)
        out = []
        for v in values:
            try:
                x = 0.0 if v is None else float(v)
            except (TypeError, ValueError):
                x = 0.0
            if not math.isfinite(x):
                x = 0.0
            if not 0.0 <= x <= 1.0 and not self._warned_range:
                logger.warning(
                    "reward function %s returned %r outside [0, 1]: clipping", self.options.reward, x
                )
                self._warned_range = True
            out.append(clamp01(x))
        return out
