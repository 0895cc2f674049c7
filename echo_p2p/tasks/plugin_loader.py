"""Loading a plug-in task's parts: reward functions named by import path, and prompt rows from a file.

Owned here: ``PluginError``, ``load_reward_function("module:function" | "path/to/file.py:function")`` and
``load_prompt_rows`` (a JSONL file, one ``{"prompt": "...", ...}`` object per line, or a dataset saved with
``datasets.save_to_disk``, only when the ``datasets`` package is installed: it is not a dependency). A
prompt is a text or, in TRL's conversational format, a list of ``{"role", "content"}`` messages
(``ml.tokenizer.check_conversation`` says which are refused); all the rows of a task are of one kind.
Called by ``tasks.plugin``. Must not import torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from echo_p2p.ml.tokenizer import check_conversation
from echo_p2p.tasks.base import TaskError

#: A reward function with TRL's GRPO signature: keyword arguments in, one reward (or None) per completion out.
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
        path = Path(module_part)
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


def load_prompt_rows(
    path: str, prompt_column: str = "prompt", split: str | None = None
) -> list[dict[str, Any]]:
    """Rows of a JSONL file or of a ``datasets.save_to_disk`` directory; each must have a string
    ``prompt_column``."""
    source = Path(path)
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
    conversational = isinstance(rows[0].get(prompt_column), list)
    for i, row in enumerate(rows):
        prompt = row.get(prompt_column)
        if conversational != isinstance(prompt, list):
            kind = "a conversation" if conversational else "a text"
            raise PluginError(
                f"{source}: row {i}'s {prompt_column!r} is not {kind} and row 0's is: a task's prompts "
                "are all texts or all conversations"
            )
        if conversational:
            try:
                row[prompt_column] = check_conversation(prompt)
            except ValueError as exc:
                raise PluginError(f"{source}: row {i}'s {prompt_column!r} is refused: {exc}") from None
        elif not isinstance(prompt, str):
            raise PluginError(
                f"{source}: row {i} has no string {prompt_column!r} column, nor a list of "
                "{role, content} messages"
            )
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
