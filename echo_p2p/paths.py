"""Paths as users write them: ``~`` and environment variables expanded, by one function.

Owned here: ``expand_path`` and ``UserPath``, the pydantic type of every path field of every config
(identity files, run records, trusted-trainers files, checkpoint, metrics and TensorBoard directories,
model files, a plug-in task's prompts and reward files), applied when a config is built, so that
``~/.echo_p2p/trainer.id`` or ``$HOME/...`` in a YAML file means what it means on a shell's command line,
and the files derived from a path (the peer cache next to an identity, the intake journal in a checkpoint
directory) land where the user meant, not under a literal ``./~``. A path that comes from elsewhere (a
``--config`` file, an owner's command) goes through ``expand_path`` too. Relative paths stay relative.
Pure: no I/O.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import AfterValidator


def expand_path(path: str) -> str:
    """``path`` with environment variables (``$VAR``, ``${VAR}``; unset ones are left as written) and a
    leading ``~`` / ``~user`` expanded."""
    return os.path.expanduser(os.path.expandvars(path))


#: A path setting: expanded when the config is validated.
UserPath = Annotated[str, AfterValidator(expand_path)]
