"""Tasks and reward verifiers: deterministic prompts from integer ids, and finite rewards.

Built-ins: ``count`` and ``letter`` (toy tasks a tiny model learns in seconds), ``arithmetic`` (levels 1-4)
and ``sokoban`` (Echo's workload); ``plugin`` takes a TRL-style reward function and a prompt file.
Used by both peer roles: the inference peer renders prompts and claims rewards, the trainer rebuilds prompts
from ids and re-scores. Importing this package never imports torch (nor does any module in it).
"""

from echo_p2p.tasks.base import Task, TaskError, TaskOptions
from echo_p2p.tasks.registry import BUILTIN_TASKS, TASK_NAMES, build_task, task_options_model

__all__ = [
    "BUILTIN_TASKS",
    "TASK_NAMES",
    "Task",
    "TaskError",
    "TaskOptions",
    "build_task",
    "task_options_model",
]
