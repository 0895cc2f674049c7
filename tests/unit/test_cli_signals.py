"""``cli.StopSignals``: Ctrl-C and SIGTERM call ``stop`` once, even after hivemind set SIGINT to ignored.

The second Ctrl-C (kill the process tree, exit 130) ends the process: it is tested on a real trainer in
``tests/integration/test_training_run.py``.
"""

from __future__ import annotations

import os
import signal

import pytest

from echo_p2p.cli import StopSignals


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_handlers_put_back_after_hivemind_ignores_sigint_stop_once(restore_handlers, capfd):
    stops = []
    signals = StopSignals(lambda: stops.append(1)).install()
    assert not signals.reassert()  # nothing replaced them
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what hivemind's averager does in the trainer process
    assert signals.reassert()
    os.kill(os.getpid(), signal.SIGINT)  # ignored without the reassert: stop never called
    assert stops == [1] and signals.received == 1
    assert "Ctrl-C: stopping" in capfd.readouterr().err
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM is not a second Ctrl-C: no exit at once
    assert stops == [1] and signals.received == 2
