"""Warm starts: one process imports what a peer needs once, and every peer is forked from it.

A peer process spends about 6 CPU-seconds before it does anything of its own, 85% of it importing torch,
transformers and hivemind (a cProfile of an inference peer's start: transformers' model code 2.4 s, torch
1.6 s, transformers' import-structure scan 1.1 s). A local swarm starts 5-7 of them at once on a machine of a
few cores, and the test suite ~50. ``ForkServer`` starts one helper process (``python -m
echo_p2p.forkserver``) that imports those modules, and nothing more: it runs no torch operation and starts no
thread of its own, as hivemind's DHT does before it forks its own child. Each peer is then a fork of it: the
child starts a session of its own (its process group is its pid, so a group signal reaches it and its
daemons, as with ``start_new_session``), takes the name it is given (``ps -o comm``: its command line is the
helper's), takes the working directory, environment and log file it was given,
reseeds Python's ``random``, and runs the module as ``python -m`` would (``runpy``), then what the
interpreter does at exit (waits for its non-daemon threads, runs the exit handlers) and exits with the
module's exit code.

``ForkedProcess`` is the caller's handle, with the parts of ``subprocess.Popen`` the local runner and the
tests use (``pid``, ``poll``, ``wait``, ``returncode``, ``send_signal``, ``terminate``, ``kill``): the helper
is the child's parent, reaps it and reports its exit status (``-N`` for a signal, as ``Popen`` does). What the
helper cannot start (another interpreter, a module outside ``FORKED_MODULES``) the caller starts as before;
a helper that failed to import or died is not used again (``ForkServer.spawn`` raises ``ForkServerError``).

A child can also be started inside a network namespace (``spawn(..., netns=NAME)``, as ``ip netns exec``
does for a new interpreter): the emulated internet of the NAT tests and the soak (``tests/netlab.py``) starts
its peers that way.

Owned here: ``ForkServer``, ``ForkedProcess``, ``FORKED_MODULES``, the helper's loop (``serve``),
``lower_priority`` (a started peer's CPU priority, forked or not) and ``enter_netns``. Called by
``echo_p2p.local``, the tests' process launcher and the network lab. Imports no torch (the helper does, in its
own process).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import logging
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The modules a forked child may run (``-m NAME``): the peers. The bootstrap is not among them: it never
#: imports torch (docs/scaling.md, start-up), and a fork of the helper would carry torch's pages.
FORKED_MODULES = frozenset({"echo_p2p.peer"})
CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2)'s network namespace type

#: What the helper imports before it forks anything: what every peer imports on its way to its first step
#: (the peer module itself is not: ``runpy`` runs it afresh as ``__main__``). Nothing that initialises CUDA
#: (bitsandbytes asks for the GPU at import): a forked child cannot use a GPU its parent initialised, so a
#: helper that finds CUDA initialised serves nothing. With these, an inference peer of a local run imports
#: 0.26 s of modules itself, of the 10 s a peer started as a new interpreter imports (``-X importtime``).
PRELOAD: tuple[str, ...] = (
    "torch",
    "hivemind",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    "echo_p2p.roles.inference",
    "echo_p2p.roles.trainer.peer",
)

#: How long ``spawn`` waits for the helper to finish its imports (it runs beside the first peers' starts)
READY_TIMEOUT_S = 180.0
#: How often the helper looks for exited children between requests
REAP_PERIOD_S = 0.1


class ForkServerError(RuntimeError):
    """The helper cannot start a process: it failed to start, to import, or is gone."""


class ForkedProcess:
    """A process forked by the helper: ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``, ``returncode``,
    ``send_signal``, ``terminate`` and ``kill``."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._orphaned = False  # the helper is gone before it reported this child's exit

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned and not _alive(self.pid):
            self._set_exit(255)  # reaped by another process: its exit status is lost
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._exited.wait(0.5 if left is None else min(0.5, left))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The caller's side: starts the helper at once (its imports run while the caller goes on) and forks
    processes from it (``spawn``); ``close`` ends the helper (the processes it forked run on: stop them
    first)."""

    def __init__(
        self,
        preload: Sequence[str] = PRELOAD,
        log: Path | None = None,
        modules: frozenset[str] = FORKED_MODULES,
    ) -> None:
        self.modules = modules  # what ``spawn`` forks (anything else: ``ForkServerError``)
        ours, theirs = socket.socketpair()
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        try:
            self._helper = subprocess.Popen(
                [sys.executable, "-m", "echo_p2p.forkserver", str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        finally:
            theirs.close()
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._replies: dict[int, dict] = {}
        self._replied = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits reported before the spawn reply was handled
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def usable(self) -> bool:
        return not self._gone.is_set()

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        *,
        log: Path,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        nice: int = 0,
        name: str = "",
        netns: str | None = None,
    ) -> ForkedProcess:
        """Fork ``python -m module args...`` from the helper, its output (stdout and stderr) to ``log``
        (made empty before this returns), in ``cwd`` (default: the caller's) with ``env`` (default: the caller's environment).
        ``name``: the process's name as ``ps -o comm``, ``top`` and ``psutil``'s ``name()`` show it (at most 15
        characters, Linux's limit; e.g. ``trainer-0``): its command line is the helper's. ``netns``: the name of a
        network namespace (``ip netns add NAME``) the child enters first, as ``ip netns exec NAME`` would
        (only its network: the mounts stay the caller's); needs the privilege to enter it."""
        if module not in self.modules:
            raise ForkServerError(f"{module} is not started by the fork server")
        if not self._ready.wait(READY_TIMEOUT_S) or self._gone.is_set():
            raise ForkServerError("the fork server is not running")
        open(log, "wb").close()  # there (and empty) when spawn returns, as a log a Popen is given
        request = {
            "module": module,
            "args": list(args),
            "log": str(log),
            "cwd": cwd or os.getcwd(),
            "env": dict(os.environ if env is None else env),
            "nice": int(nice),
            "name": name,
            "netns": netns,
        }
        with self._lock:
            self._next_id += 1
            request["id"] = ident = self._next_id
            try:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError as exc:
                raise ForkServerError(f"the fork server is gone: {exc}") from exc
            with self._replied:
                if not self._replied.wait_for(lambda: ident in self._replies or self._gone.is_set(), 30):
                    raise ForkServerError("the fork server did not answer")
                reply = self._replies.pop(ident, None)
                if reply is None or "pid" not in reply:
                    raise ForkServerError(f"the fork server could not fork: {reply}")
                child = ForkedProcess(int(reply["pid"]), [sys.executable, "-m", module, *args])
                self._children[child.pid] = child
                if child.pid in self._early_exits:
                    child._set_exit(self._early_exits.pop(child.pid))
        return child

    def spawn_argv(self, argv: Sequence[str], **options: Any) -> ForkedProcess | None:
        """``argv`` (what follows the interpreter: ``-m MODULE ARGS...``) forked with ``spawn``'s keyword
        ``options``; None when it is not a module this helper forks, the helper is gone, or the fork failed
        (logged): the caller then starts a new interpreter."""
        if len(argv) < 2 or argv[0] != "-m" or argv[1] not in self.modules or not self.usable:
            return None
        try:
            return self.spawn(argv[1], argv[2:], **options)
        except ForkServerError as exc:
            logger.warning("fork server: %s; starting %s as a new interpreter", exc, argv[1])
            return None

    def close(self, timeout: float = 5.0) -> None:
        """End the helper (EOF on its socket), and kill it when it does not go within ``timeout``."""
        self._gone.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._helper.wait(timeout)
        except subprocess.TimeoutExpired:
            self._helper.kill()
            self._helper.wait()

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._handle(json.loads(line))
        except (OSError, ValueError) as exc:
            logger.debug("fork server connection ended: %r", exc)
        finally:
            with self._replied:
                self._gone.set()
                for child in self._children.values():
                    child._orphaned = True
                self._replied.notify_all()
            self._ready.set()  # a waiting spawn sees the helper gone

    def _handle(self, message: dict) -> None:
        if message.get("ready"):
            self._ready.set()
        elif "exited" in message:
            pid, code = int(message["exited"]), int(message["code"])
            with self._replied:
                child = self._children.pop(pid, None)
                if child is None:
                    self._early_exits[pid] = code
            if child is not None:
                child._set_exit(code)
        elif "id" in message:
            with self._replied:
                self._replies[int(message["id"])] = message
                self._replied.notify_all()


def lower_priority(nice: int) -> None:
    """Run in a child after ``setsid``: lower its CPU priority by ``nice``.

    With autogroup scheduling (Linux's default on desktops and many servers) each session is scheduled as
    one group and a process's own nice value only ranks it inside its session, so a child in a new session
    is niced through ``/proc/self/autogroup`` as well.
    """
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroup (or not Linux): the process nice value above is what counts


def enter_netns(name: str) -> None:
    """Move this process into the network namespace ``name`` (``/run/netns/NAME``, made by ``ip netns add``)."""
    import ctypes

    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"not a network namespace name: {name!r}")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the helper's side -------------------------------------------------------------------------------------
def serve(fd: int, preload: Sequence[str]) -> None:
    """The helper's loop: import ``preload``, say ready, then fork a child per request and report each
    child's exit, until the caller closes the socket."""
    sock = socket.socket(fileno=fd)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional module: the child imports what it needs itself
            print(f"fork server: could not preload {name}: {exc!r}", file=sys.stderr)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use the GPU
        print("fork server: CUDA was initialised by a preloaded module; not serving", file=sys.stderr)
        return
    gc.collect()
    gc.freeze()  # the imported objects stay out of the children's collections: their pages stay shared
    _send(sock, {"ready": True, "modules": len(sys.modules)})
    buffer = b""
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_PERIOD_S)
        _reap(sock)
        if not readable:
            continue
        data = sock.recv(65536)
        if not data:
            return  # the caller is gone; its processes are its own to stop
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                _send(sock, {"id": request["id"], "error": repr(exc)})
                continue
            if pid == 0:
                _child(sock, request)  # never returns
            _send(sock, {"id": request["id"], "pid": pid})


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(sock: socket.socket, request: dict) -> None:
    """In the forked child: become the process the request describes, run its module, exit."""
    code = 1
    try:
        sock.close()
        os.setsid()
        os.chdir(request["cwd"])
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # the caller made it
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if request.get("netns"):  # before the module opens any socket; a failure goes to the log
            enter_netns(str(request["netns"]))
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("name"):
            try:
                with open("/proc/self/comm", "w") as comm:
                    comm.write(str(request["name"])[:15])
            except OSError:
                pass  # not Linux: the helper's name stays
        if request.get("nice"):
            lower_priority(int(request["nice"]))
        random.seed()
        _fresh_hivemind_locks()
        code = _run_module(request["module"], request["args"])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _fresh_hivemind_locks() -> None:
    """Give this child its own copies of the cross-process locks hivemind makes when it is imported
    (``MPFuture``'s and ``SharedBytes``' in ``hivemind.utils.mpfuture``, the context executor's in
    ``hivemind.utils.asyncio``). Made in the helper, they would be one semaphore shared by every peer forked from
    it, unrelated processes: a peer SIGKILLed while it held one (it takes them for every new process's future
    backend and every 16 shared bytes) left it held for good, and every peer forked afterwards hung starting its
    DHT ("the DHT node did not start within 30 s", four tests in a row of a suite run). A fresh child has no
    futures yet, so hivemind's own reset is safe here; its DHT children inherit the child's locks, as hivemind
    intends."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()
    asyncio_utils = sys.modules.get("hivemind.utils.asyncio")
    if asyncio_utils is not None:
        import multiprocessing

        asyncio_utils._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _run_module(module: str, args: Sequence[str]) -> int:
    """``python -m module args...`` in this process, and what the interpreter does at exit; the exit code."""
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's wait for non-daemon threads
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _exit_code(value: object) -> int:
    """The process exit status of ``sys.exit(value)``, as the interpreter makes it."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
