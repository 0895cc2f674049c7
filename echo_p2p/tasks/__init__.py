"""Tasks and reward verifiers: deterministic prompts from integer ids, and finite rewards.

Built-ins: ``count`` and ``letter`` (toy tasks a tiny model learns in seconds), ``arithmetic`` (levels 1-4)
and ``sokoban`` (Echo's workload); ``plugin`` takes a TRL-style reward function and a prompt file
(``plugin_loader`` loads the function, ``plugin_rewards`` calls it). ``base`` holds ``Task`` and its
options; ``registry`` builds a task by name (``build_task``).
Used by both peer roles: the inference peer renders prompts and claims rewards, the trainer rebuilds prompts
from ids and re-scores. No module here imports torch; nothing is imported here.
"""
