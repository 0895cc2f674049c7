"""The monitor's alerts: pure rules over a status dict (``monitor.status``) and the ``Timers`` a running
monitor keeps between reads (``monitor.history``).

Each rule returns one alert or None; an alert is ``{"code", "severity", "message", "peers"}`` (at most
``MAX_ALERT_PEERS`` peer ids). The codes, what they mean and what to look at are listed in ``ALERTS``
(the README's monitor section repeats them). Rules that need time (``version_stalled``, ``buffer_empty``)
stay silent without timers, as in a one-shot ``swarm status``. Callers: ``monitor.status.build_status``.
No I/O, no clock: ``Timers.now`` is the time of the status.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from echo_p2p.monitor.config import MonitorConfig

MAX_ALERT_PEERS = 20

#: code -> (severity, meaning)
ALERTS: dict[str, tuple[str, str]] = {
    "dht_unreachable": (
        "critical",
        "the monitor's DHT reads fail or time out, or it is connected to no peer",
    ),
    "no_trainer": ("critical", "no running trainer of the run is in the directory"),
    "version_stalled": ("warning", "no new policy version for stall_after seconds"),
    "peer_lagging": ("warning", "inference peers hold a version older than the staleness bound allows"),
    "untrusted_manifests": ("warning", "policy records published by keys the run does not trust (refused)"),
    "impostor": ("warning", "peers announce themselves trainers without being in the run record"),
    "banned_peers": ("info", "the run's trainers banned senders (e.g. for lying about log-probs)"),
    "buffer_empty": ("warning", "a trainer's replay buffer stayed empty and it consumed nothing"),
    "samplers_waiting": (
        "info",
        "most inference peers wait for the trainers' grants most of the time: the run needs no more samplers",
    ),
    "peer_stalled": (
        "warning",
        "peers announce that their watchdog found a stall (a progress signal past its deadline: its log "
        "has the thread dump)",
    ),
}
#: Share of its time an inference peer waits for grants above which it counts as waiting (samplers_waiting).
WAITING_SHARE = 0.5


@dataclass(frozen=True)
class Timers:
    """What a running monitor remembers between reads (all wall-clock seconds)."""

    now: float
    watching_since: float
    version_since: float | None = None  # when the newest version was first seen (None: none yet)
    starved_since: dict[str, float] = field(default_factory=dict)  # trainer -> buffer empty, nothing consumed


def alert(code: str, message: str, peers: list[str] | None = None) -> dict[str, Any]:
    return {
        "code": code,
        "severity": ALERTS[code][0],
        "message": message,
        "peers": [p for p in (peers or []) if p][:MAX_ALERT_PEERS],
    }


def _dht_unreachable(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    dht = status.get("dht") or {}
    if dht.get("ok", True):
        return None
    return alert("dht_unreachable", f"DHT: {dht.get('error') or 'unreachable'}")


def _no_trainer(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    if not (status.get("dht") or {}).get("ok", True):
        return None  # an empty read says nothing about the trainers
    summary = status["summary"]
    if summary["trainers"] > 0:
        return None
    message = "no running trainer of the run is in the directory"
    if summary.get("impostors"):
        message += f" ({summary['impostors']} peer(s) not in the run record announce themselves trainers)"
    return alert("no_trainer", message)


def _version_stalled(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    if timers is None or timers.now - timers.watching_since < config.stall_after:
        return None
    if status["summary"]["trainers"] == 0:
        return None  # no_trainer says it already
    newest = status["summary"]["newest_version"]
    since = timers.version_since if timers.version_since is not None else timers.watching_since
    waited = timers.now - since
    if waited < config.stall_after:
        return None
    if newest is None:
        return alert("version_stalled", f"no policy version published in {waited:.0f} s")
    return alert("version_stalled", f"no new policy version for {waited:.0f} s (newest: {newest})")


def _peer_lagging(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    bound = status["summary"]["max_staleness"]
    lagging = [
        r["peer_id"]
        for r in status["peers"]
        if r["role"] == "inference" and r["state"] == "running" and r["lag"] is not None and r["lag"] > bound
    ]
    if not lagging:
        return None
    return alert(
        "peer_lagging",
        f"{len(lagging)} inference peer(s) more than {bound} versions behind the newest "
        f"({status['summary']['newest_version']}): their rollouts are dropped as stale",
        lagging,
    )


def _untrusted_manifests(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    rogue = [p for p in status.get("publishers", []) if p["trusted"] is False]
    if not rogue:
        return None
    return alert(
        "untrusted_manifests",
        f"{len(rogue)} policy record(s) published by keys the run does not trust: peers refuse their manifests",
        [p["peer_id"] for p in rogue],
    )


def _impostor(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    impostors = [r["peer_id"] for r in status["peers"] if r["trusted"] is False]
    if not impostors:
        return None
    return alert(
        "impostor",
        f"{len(impostors)} peer(s) announce themselves trainers but are not the run's: nobody pushes to them",
        impostors,
    )


def _banned_peers(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    bans = status.get("bans") or []
    if not bans:
        return None
    banned = list(dict.fromkeys(b["peer_id"] for b in bans))
    reasons = sorted({b["reason"] for b in bans if b["reason"]})
    why = f" ({', '.join(reasons[:4])})" if reasons else ""
    return alert("banned_peers", f"{len(banned)} peer(s) banned by the run's trainers{why}", banned)


def _buffer_empty(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    if timers is None:
        return None
    starved = [
        p for p, since in timers.starved_since.items() if timers.now - since >= config.buffer_empty_after
    ]
    if not starved:
        return None
    return alert(
        "buffer_empty",
        f"{len(starved)} trainer(s) with an empty replay buffer and no rollout consumed for "
        f"{config.buffer_empty_after:.0f} s or more: no inference peer reaches them",
        sorted(starved),
    )


def _samplers_waiting(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    samplers = [
        p
        for p in status.get("peers") or []
        if p.get("role") == "inference"
        and p.get("waiting_for_grants") is not None
        and p.get("trusted") is not False
    ]
    waiting = [p for p in samplers if p["waiting_for_grants"] > WAITING_SHARE]
    if not samplers or 2 * len(waiting) <= len(samplers):
        return None
    mean = sum(p["waiting_for_grants"] for p in samplers) / len(samplers)
    return alert(
        "samplers_waiting",
        f"{len(waiting)} of {len(samplers)} inference peers wait for the trainers' grants most of the time "
        f"({100 * mean:.0f}% on average): the run needs no more samplers, its trainers would use more",
        [p["peer_id"] for p in waiting],
    )


def _peer_stalled(status: dict, config: MonitorConfig, timers: Timers | None) -> dict | None:
    stalled = [p for p in status.get("peers") or [] if p.get("stalled") and p.get("state") == "running"]
    if not stalled:
        return None
    signals = sorted({s for p in stalled for s in p["stalled"]})
    return alert(
        "peer_stalled",
        f"{len(stalled)} peer(s) report a stall ({', '.join(signals[:8])}): no progress within the "
        "watchdog's deadline; the peer's log has what each thread waits on",
        [p["peer_id"] for p in stalled],
    )


RULES: tuple[Callable[[dict, MonitorConfig, Timers | None], dict | None], ...] = (
    _dht_unreachable,
    _no_trainer,
    _version_stalled,
    _peer_lagging,
    _untrusted_manifests,
    _impostor,
    _banned_peers,
    _buffer_empty,
    _samplers_waiting,
    _peer_stalled,
)


def evaluate(status: dict[str, Any], config: MonitorConfig, timers: Timers | None = None) -> list[dict]:
    """Every alert that fires for ``status``, most severe first."""
    found = [a for rule in RULES if (a := rule(status, config, timers)) is not None]
    order = {"critical": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda a: order[a["severity"]])
