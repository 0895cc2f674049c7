"""Shared command-line plumbing: network flags, config errors -> exit 2, signals -> clean stop.

Callers: the ``bootstrap``, ``peer``, ``swarm`` and ``local`` entry points. Must stay cheap to import
(``--help`` is instant): no torch, no hivemind at module level.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from echo_p2p.net.sockets import remove_private_socket_dir

EXIT_CONFIG = 2  #: invalid flags or configuration (before any network start)
EXIT_START = 1  #: could not start or join (port busy, initial peers silent, bad identity file)
EXIT_INTERRUPTED = 130  #: stopped at once by a second Ctrl-C (128 + SIGINT, as a shell reports it)
#: a peer's watchdog found a stall and ``--restart-on-stall`` was given (EX_TEMPFAIL: start it again;
#: ``roles.watchdog``, docs/reliability.md)
EXIT_STALLED = 75


def add_network_flags(parser: argparse.ArgumentParser, *, host_default_help: str) -> None:
    group = parser.add_argument_group("network")
    group.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        default=None,
        help="multiaddrs of known peers, as printed by a bootstrap (env ECHO_INITIAL_PEERS)",
    )
    group.add_argument(
        "--host-maddrs",
        nargs="+",
        metavar="MADDR",
        default=None,
        help=f"multiaddrs to listen on ({host_default_help}; env ECHO_HOST_MADDRS)",
    )
    group.add_argument(
        "--announce-maddrs",
        nargs="+",
        metavar="MADDR",
        default=None,
        help="multiaddrs to tell others (e.g. your public IP and forwarded port; env ECHO_ANNOUNCE_MADDRS)",
    )
    group.add_argument(
        "--reachability",
        choices=["auto", "public", "private"],
        default=None,
        help="whether others can dial this node: auto (default for peers: AutoNAT tells; behind NAT the node "
        "is reached through a relay), public (default for a bootstrap) or private",
    )
    group.add_argument(
        "--relays",
        nargs="*",
        metavar="MADDR",
        default=None,
        help="relays to be reached through when behind NAT (default: the initial peers; none: no relay)",
    )
    group.add_argument(
        "--identity-path",
        metavar="FILE",
        default=None,
        help="private key file, created when missing: keeps the peer id across restarts (env ECHO_IDENTITY_PATH)",
    )
    group.add_argument(
        "--startup-timeout",
        type=float,
        metavar="S",
        default=None,
        help="deadline to start and join (default 30)",
    )
    group.add_argument(
        "--knock-timeout",
        type=float,
        metavar="S",
        default=None,
        help="how long to keep dialing initial peers that do not answer, e.g. a bootstrap still starting "
        "(default 5)",
    )


def network_flags(args: argparse.Namespace) -> dict[str, object]:
    return {
        "network.initial_peers": args.initial_peers,
        "network.host_maddrs": args.host_maddrs,
        "network.announce_maddrs": args.announce_maddrs,
        "network.identity_path": args.identity_path,
        "network.reachability": args.reachability,
        "network.relays": args.relays,
        "network.startup_timeout": args.startup_timeout,
        "network.knock_timeout": args.knock_timeout,
    }


def task_option(text: str) -> tuple[str, object]:
    """``--task-option KEY=VALUE``: the value is read as a YAML scalar (``9`` is an int, ``abc`` a string)."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"bad value in {text!r}: {exc}") from None
    return key.strip(), parsed


def add_task_option_flag(parser, *, pass_through: bool = False) -> None:
    """``--task-option KEY=VALUE`` (repeatable) on ``parser`` (or an argument group); the parsed value is a
    list of ``(key, value)`` pairs, or of the checked ``KEY=VALUE`` texts with ``pass_through`` (a launcher
    hands them on to the processes it starts, unchanged)."""

    def checked_text(text: str) -> str:
        task_option(text)
        return text

    parser.add_argument(
        "--task-option",
        action="append",
        type=checked_text if pass_through else task_option,
        metavar="KEY=VALUE",
        default=[],
        help="an option of the task, e.g. --task-option max_n=9 (repeatable)",
    )


def fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


class StopSignals:
    """Ctrl-C and SIGTERM stop this process cleanly; a second Ctrl-C stops it at once.

    The first SIGINT or SIGTERM calls ``stop()`` (once) and says so on stderr; a second SIGINT kills every
    descendant of this process (DHT child, p2pd, averager processes, the peers a launcher started) with
    SIGKILL and exits ``EXIT_INTERRUPTED`` without waiting for the clean stop. hivemind sets SIGINT to
    ignored in a process that starts an averager (``hivemind.Optimizer``) and a process may inherit it
    ignored: ``reassert()`` puts these handlers back; callers call it after building such parts.
    """

    def __init__(self, stop: Callable[[], None]):
        self._stop = stop
        self.received = 0

    def install(self) -> StopSignals:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def reassert(self) -> bool:
        """Install the handlers again if something replaced them; True if it had to."""
        replaced = any(signal.getsignal(s) != self._handle for s in (signal.SIGINT, signal.SIGTERM))
        if replaced:
            self.install()
        return replaced

    def _handle(self, signum: int, _frame) -> None:
        self.received += 1
        if self.received == 1:
            interrupted = signum == signal.SIGINT
            _say("Ctrl-C: stopping (press it again to stop at once)" if interrupted else "SIGTERM: stopping")
            self._stop()
        elif signum == signal.SIGINT:
            _say("stopping at once")
            kill_descendants()
            remove_private_socket_dir()
            os._exit(EXIT_INTERRUPTED)


def _say(text: str) -> None:
    """One line on stderr from a signal handler (no logging lock, no buffered stream)."""
    try:
        os.write(2, f"{text}\n".encode())
    except OSError:
        pass


def kill_descendants() -> int:
    """SIGKILL every process this one started, and theirs (found by parent pid, never by name); the count."""
    import psutil

    try:
        found = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for proc in found:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return len(found)


def install_stop_handlers(stop: Callable[[], None]) -> StopSignals:
    """``StopSignals(stop)``, installed."""
    return StopSignals(stop).install()


def run_peer(peer, what: str) -> None:
    """Start ``peer``, run it until a signal, always shut it down; exit 0, 1 with a clear start error, or
    the peer's ``exit_code`` when its role stopped on a fatal error or a stall (``EXIT_STALLED``).

    ``peer`` has ``start``, ``run``, ``request_stop`` and an idempotent ``shutdown``. Expected start-up
    failures (DHT start, a model not on disk, a bad option or file) print one line instead of a traceback.
    """
    from echo_p2p.net.node import NodeStartError

    signals = install_stop_handlers(peer.request_stop)
    try:
        try:
            peer.start()
        except (FileNotFoundError, ValueError) as exc:
            raise NodeStartError(f"the {what} could not start: {exc}") from exc
        signals.reassert()  # hivemind.Optimizer's averagers set SIGINT to ignored in this process
        peer.run()
    except NodeStartError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)  # said before the clean stop, which takes seconds
        peer.shutdown()
        sys.exit(EXIT_START)
    finally:
        peer.shutdown()
    sys.exit(getattr(peer, "exit_code", 0))
