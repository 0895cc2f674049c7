"""A module the fork server's tests run as ``python -m tests.forked_child MODE OUT``: what a forked peer sees.

``report``: writes its pid, process group, working directory, argv, ``ECHO_TEST`` and a random number to OUT,
its network namespace, prints to stdout and stderr, exits 3. ``linger``: a non-daemon thread that finishes after the module returns
and an exit handler, each writing a file next to OUT. ``raise``: an uncaught exception. ``sleep``: sleeps. ``hold``: takes hivemind's
cross-process locks, writes OUT, sleeps (to be killed). ``future``: makes an MPFuture and the context executor,
writes OUT.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "report":
        with open(out, "w") as f:
            json.dump(
                {
                    "pid": os.getpid(),
                    "pgid": os.getpgid(0),
                    "cwd": os.getcwd(),
                    "argv": sys.argv[1:],
                    "env": os.environ.get("ECHO_TEST"),
                    "random": random.random(),
                    "name": __name__,
                    "comm": open("/proc/self/comm").read().strip(),
                    "netns": os.stat("/proc/self/ns/net").st_ino,
                },
                f,
            )
        print("to stdout")
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if mode == "linger":

        def late() -> None:
            time.sleep(0.5)
            with open(out + ".thread", "w") as f:
                f.write("done")

        threading.Thread(target=late).start()
        atexit.register(lambda: open(out + ".atexit", "w").write("done"))
        return
    if mode == "raise":
        raise RuntimeError("boom from the forked child")
    if mode == "sleep":
        time.sleep(60)
    if mode == "hold":  # takes hivemind's cross-process locks and waits to be killed holding them
        from hivemind.utils.asyncio import _AsyncContextWrapper
        from hivemind.utils.mpfuture import MPFuture, SharedBytes

        for lock in (
            MPFuture._initialization_lock,
            MPFuture._update_lock,
            SharedBytes._lock,
            _AsyncContextWrapper.EXECUTOR_LOCK,
        ):
            lock.acquire()
        with open(out + ".tmp", "w") as f:
            f.write("held")
        os.replace(out + ".tmp", out)  # whole: the test polls for the file and reads it at once
        time.sleep(60)
    if mode == "future":  # what a peer's DHT start does first: a future backend, shared bytes, the executor
        from hivemind.utils.asyncio import _AsyncContextWrapper
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        future.set_result(7)
        _AsyncContextWrapper.get_process_wide_executor()
        open(out, "w").write(f"ok {future.result()}")


if __name__ == "__main__":
    main()
