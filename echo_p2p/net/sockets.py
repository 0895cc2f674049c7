"""Where a process's libp2p daemon and client sockets live: a folder of its own, removed when it exits.

hivemind's ``P2P`` puts every daemon's and every client's Unix socket straight in /tmp
(``hivemind-p2pd-*.sock``, ``hivemind-p2pclient-*.sock``) and removes them only on an orderly shutdown of
that ``P2P``. A peer stopped by a signal, a DHT child that is terminated, a daemon that dies first (the local
runner's SIGKILL of a process group) or a replica that is never closed leave theirs behind: a dozen files
in /tmp after a few local runs, for good. ``use_private_socket_dir`` points ``P2P`` at a folder of this
process's own under /tmp (the DHT child, forked, inherits it; hivemind's own replicas for the averagers go
there too) and removes the folder with whatever is in it when the process exits (normally, or through a
SIGTERM handler that exits; the exits through ``os._exit`` call ``remove_private_socket_dir`` first). A
process killed with SIGKILL leaves its folder: nothing runs then; the folder names the process
(``echo-p2p-PID-*``), and the next process to make one removes those of processes that are gone.

Owned here: ``use_private_socket_dir``, ``remove_private_socket_dir`` and ``remove_stale_socket_dirs``. Imports only
``hivemind.p2p.p2p_daemon`` (no torch); the prefix it sets is a class attribute of the pinned hivemind
(``P2P._UNIX_SOCKET_PREFIX``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

_lock = threading.Lock()
_folder: tuple[int, str] | None = None  # (the process that made it, its path)


def use_private_socket_dir() -> str:
    """Make this process's socket folder (once per process; a forked child that calls it gets its own) and
    point hivemind's ``P2P`` at it; returns its path."""
    global _folder
    from hivemind.p2p.p2p_daemon import P2P

    with _lock:
        if _folder is not None and _folder[0] == os.getpid() and os.path.isdir(_folder[1]):
            return _folder[1]
        # /tmp as hivemind has it (a Unix socket's path must stay under ~100 bytes; $TMPDIR may be long)
        base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
        remove_stale_socket_dirs(base)
        folder = tempfile.mkdtemp(prefix=f"echo-p2p-{os.getpid()}-", dir=base)
        P2P._UNIX_SOCKET_PREFIX = f"/unix{folder}/hivemind-"
        _folder = (os.getpid(), folder)
        atexit.register(_remove, os.getpid(), folder)
        return folder


def remove_stale_socket_dirs(base: str) -> list[str]:
    """Remove the socket folders under ``base`` of processes that are gone (a SIGKILL leaves its folder: no
    exit handler runs), ours only (same user); returns them. A folder names its process (``echo-p2p-PID-*``);
    one whose pid is alive, or was taken by another process since, is left."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["echo", "p2p"] or not parts[2].isdigit():
            continue
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid != os.getuid() or _alive(int(parts[2])):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_private_socket_dir() -> None:
    """Remove this process's socket folder now: for the exits that skip exit handlers (``os._exit`` after a
    stall that would not stop, a second Ctrl-C), once the processes that used it are killed."""
    if _folder is not None:
        _remove(*_folder)


def _remove(owner: int, folder: str) -> None:
    if os.getpid() == owner:  # not in a forked child that runs the parent's exit handlers
        shutil.rmtree(folder, ignore_errors=True)
