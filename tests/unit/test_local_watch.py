"""The local swarm's watch loop ends a run when its duration is over, not at the next status line, and says
what each process is doing until the first training step (``local_phases``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from echo_p2p.local import Child, LocalSwarmConfig, _watch_loop


def test_the_duration_ends_the_run_between_two_status_lines_and_each_process_says_what_it_does(
    tmp_path, capsys
):
    logs = tmp_path / "logs"
    logs.mkdir()
    stamp = time.strftime("%H:%M:%S")
    (logs / "trainer-0.log").write_text(
        f"{stamp} [INFO] echo_p2p.roles.base: [abcdefgh trainer v-] joining run 'local'\n"
        "Failed to load an optional kernel\n"  # not an echo_p2p line: skipped
        f"{stamp} [INFO] echo_p2p.roles.base: [abcdefgh trainer v-] loading the model and the task\n"
        "Traceback-looking noise that is not a log line\n"
    )
    (logs / "inference-0.log").write_text("")  # still importing torch
    children = [Child(name, None, logs / f"{name}.log") for name in ("trainer-0", "inference-0")]
    children.append(Child("inference-1", None, logs / "missing.log"))
    config = LocalSwarmConfig(duration=1.0, status_period=30.0)
    swarm = SimpleNamespace(
        config=config,
        workdir=tmp_path,
        stop_event=threading.Event(),
        dead_children=lambda: [],
        children=children,
    )
    t0 = time.monotonic()
    assert _watch_loop(swarm, lambda: "run local: 0 peer(s)") == 0
    assert time.monotonic() - t0 < 10  # was 30: the first check after the duration came a status period later
    out = capsys.readouterr().out
    assert "run local: 0 peer(s)" in out
    phases = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.startswith("  ")}
    assert phases["trainer-0"].startswith("loading the model and the task ("), phases
    assert phases["trainer-0"].endswith(" s ago)")
    assert phases["inference-0"] == "starting (importing its libraries)"
    assert phases["inference-1"] == "not started"
