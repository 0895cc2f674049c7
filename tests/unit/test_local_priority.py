"""Inference peers of a local swarm yield the CPU to trainers, also under autogroup scheduling."""

from __future__ import annotations

import os
import subprocess
import sys

from echo_p2p.forkserver import lower_priority


def test_a_child_in_its_own_session_is_niced_and_so_is_its_autogroup():
    code = (
        "import os\n"
        "print(os.nice(0))\n"
        "try:\n"
        "    print(open('/proc/self/autogroup').read().split()[-1])\n"
        "except OSError:\n"
        "    print('none')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: lower_priority(5),
        start_new_session=True,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    assert int(out[0]) == os.nice(0) + 5
    if os.path.exists("/proc/self/autogroup"):
        assert out[1] == "5", "the child's session (autogroup) was not niced"
