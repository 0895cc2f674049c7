"""A process's libp2p sockets go to a folder of its own, removed at its exit even when hivemind's own clean-up
never runs (``net.sockets``): a daemon that died first (a process group's SIGKILL) and a replica never
closed left their socket files in /tmp for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = """
import asyncio, json, os, signal
from echo_p2p.net.lean_hivemind import use_lean_hivemind
use_lean_hivemind()
from echo_p2p.net.sockets import use_private_socket_dir
from hivemind.p2p.p2p_daemon import P2P

async def main():
    folder = use_private_socket_dir()
    assert use_private_socket_dir() == folder  # once per process
    p2p = await P2P.create()
    replica = await P2P.replicate(p2p.daemon_listen_maddr)

    async def handler(stream_info, reader, writer):
        writer.close()

    await p2p.add_binary_stream_handler("a", handler)  # a client listens once it serves a handler
    await replica.add_binary_stream_handler("b", handler)
    sockets = sorted(os.listdir(folder))
    paths = [str(p2p.daemon_listen_maddr), str(p2p._client_listen_maddr), str(replica._client_listen_maddr)]
    os.kill(p2p._child.pid, signal.SIGKILL)  # the daemon dies first, as under a process group's SIGKILL
    await p2p._child.wait()
    print(json.dumps({"folder": folder, "sockets": sockets, "paths": paths}), flush=True)

asyncio.run(main())
"""


def test_a_processs_sockets_live_in_its_own_folder_which_its_exit_removes():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    folder = seen["folder"]
    assert os.path.basename(folder).startswith("echo-p2p-") and len(folder) < 40
    # the daemon's socket and both clients' (the P2P's own and a replica's), all inside the folder
    assert len(seen["sockets"]) == 3 and all(name.startswith("hivemind-p2p") for name in seen["sockets"])
    assert sorted(seen["paths"]) == [f"/unix{folder}/{name}" for name in seen["sockets"]], seen
    assert not os.path.exists(folder)  # removed at exit, sockets and all


def test_the_folders_of_processes_that_are_gone_are_removed_by_the_next_one(tmp_path):
    """A SIGKILL leaves a process's folder (no exit handler runs): the next process to make one removes the
    folders of processes that are gone, and leaves those of live ones and folders not named by a pid."""
    from echo_p2p.net.sockets import remove_stale_socket_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid is free now (reaped)
    dead = tmp_path / f"echo-p2p-{gone.pid}-abcd1234"
    live = tmp_path / f"echo-p2p-{os.getpid()}-abcd1234"
    other = tmp_path / "echo-p2p-abcd1234"  # an older release's name: not ours to judge
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "hivemind-p2pclient-x.sock").write_text("")
    assert remove_stale_socket_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and other.exists()
