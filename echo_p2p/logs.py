"""One log format for every echo_p2p process; status lines carry peer id, role and version.

Callers: the CLI modules, once, before anything else logs. hivemind keeps its own handler for its own
loggers; we only set their level so that a peer's output stays readable.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s [%(levelname)s] %(name)s: %(message)s"


def setup_logging(level: str = "INFO") -> None:
    root = logging.getLogger("echo_p2p")
    if not any(getattr(h, "_echo", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._echo = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)
    # hivemind reads its level from the environment in every process it starts (the DHT's child too)
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING" if level != "DEBUG" else "INFO")
    # hivemind is chatty at INFO about internals (identity generation, averaging rounds)
    logging.getLogger("hivemind").setLevel(max(logging.getLevelName(level), logging.WARNING))


def status_prefix(peer_id: str, role: str, version: int | None) -> str:
    """``[<short peer id> <role> v<version>]`` — the start of every status line."""
    return f"[{peer_id[-8:]} {role} v{'-' if version is None else version}]"
