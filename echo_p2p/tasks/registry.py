"""Task registry: build a task from its name and an options mapping (the run config's ``task`` section).

Owned here: ``build_task(name, options)``, ``BUILTIN_TASKS`` and ``TASK_NAMES``.
Called by peers (both roles build the same task from the run config) and by the config validation.
Must not import torch. Unknown names and bad options raise ``TaskError`` with a message that names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from echo_p2p.tasks.arithmetic import ArithmeticOptions, ArithmeticTask
from echo_p2p.tasks.base import Task, TaskError, TaskOptions
from echo_p2p.tasks.count import CountOptions, CountTask, LetterOptions, LetterTask
from echo_p2p.tasks.plugin import PluginOptions, PluginTask
from echo_p2p.tasks.sokoban import SokobanOptions, SokobanTask

_TASKS: dict[str, tuple[type[Task], type[TaskOptions]]] = {
    "count": (CountTask, CountOptions),
    "letter": (LetterTask, LetterOptions),
    "arithmetic": (ArithmeticTask, ArithmeticOptions),
    "sokoban": (SokobanTask, SokobanOptions),
    "plugin": (PluginTask, PluginOptions),
}

#: Tasks that need no file: usable with no options at all.
BUILTIN_TASKS: tuple[str, ...] = ("count", "letter", "arithmetic", "sokoban")
#: Every name ``build_task`` accepts.
TASK_NAMES: tuple[str, ...] = (*BUILTIN_TASKS, "plugin")


def task_options_model(name: str) -> type[TaskOptions]:
    """The pydantic options class of task ``name`` (its fields document every option)."""
    if name not in _TASKS:
        raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
    return _TASKS[name][1]


def build_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """The task ``name`` configured by ``options`` (validated; unknown options are errors)."""
    options_cls = task_options_model(name)
    try:
        opts = options_cls.model_validate(dict(options or {}))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or name}: {e['msg']}" for e in exc.errors())
        raise TaskError(f"bad options for task {name!r}: {problems}") from None
    return _TASKS[name][0](opts)
