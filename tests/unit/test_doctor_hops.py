"""The doctor's walk: hops in order, stop at the first that fails and keep its message (no network)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from echo_p2p.doctor import Doctor, Hop, HopFailed
from echo_p2p.net.run_record import JoinAddress

ADDRESS = "demo:QmVBs4rtbHeMREzjEUBfqKvRsHfvPFy9RFAZMr9K23gFyb@/ip4/127.0.0.1/tcp/4001/p2p/QmVBs4rtbHeMREzjEUBfqKvRsHfvPFy9RFAZMr9K23gFyb"


class Scripted(Doctor):
    """A doctor whose hops are scripted: each passes, or raises ``HopFailed`` where told."""

    def __init__(self, fail_at: str | None):
        super().__init__(JoinAddress.parse(ADDRESS), network=None)
        self.fail_at = fail_at
        self.called: list[str] = []

    def hops(self):
        def check(name):
            def run():
                self.called.append(name)
                if name == self.fail_at:
                    raise HopFailed(f"{name} is broken: fix it")
                return f"{name} fine"

            return run

        return [(name, check(name)) for name, _ in super().hops()]


def test_every_hop_is_walked_in_order_when_all_pass():
    doctor = Scripted(None)
    hops = doctor.run()
    assert [h.name for h in hops] == [
        "bootstrap", "clock", "run record", "trainers", "trainer reachable", "weights", "room", "this machine",
    ]  # fmt: skip
    assert all(h.ok for h in hops)


def test_the_walk_stops_at_the_first_failing_hop_with_its_message():
    doctor = Scripted("run record")
    seen: list[Hop] = []
    hops = doctor.run(seen.append)
    assert doctor.called == ["bootstrap", "clock", "run record"]
    assert seen == hops and [h.ok for h in hops] == [True, True, False]
    assert hops[-1].detail == "run record is broken: fix it"


def test_a_bad_address_is_a_config_error_and_help_imports_no_torch():
    r = subprocess.run(
        [sys.executable, "-m", "echo_p2p.doctor", "--join", "demo@nothing"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "a join address is RUN_ID:OWNER_PEER_ID@" in r.stderr
    code = "import sys, echo_p2p.doctor as d; d.main(['--help'])"
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "usage: python -m echo_p2p.doctor" in r.stdout
    assert not re.search(r"\|\s+torch(\.|$)", r.stderr, re.MULTILINE)


class FakeReach:
    """What a node's daemon says of its own addresses, in turn (``net.reachability.Reachability``)."""

    def __init__(self, answers):
        self.answers = list(answers)

    def current(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@pytest.mark.parametrize(
    "answers, ok, text",
    [
        ([([], "unreachable"), (["/ip4/127.0.0.1/tcp/5/p2p/QmA"], "direct")], True, "dial it directly"),
        ([(["/ip4/9.9.9.9/tcp/1/p2p/QmR/p2p-circuit/p2p/QmA"], "relayed")], True, "relay reservation"),
        ([([], "unreachable")], False, "no relay slot was reserved"),
    ],
)
def test_this_machine_is_reachable_directly_or_through_a_relay_or_the_hop_says_how_to_fix_it(
    monkeypatch, answers, ok, text
):
    import echo_p2p.doctor as doctor_module
    import echo_p2p.net.reachability as reachability

    monkeypatch.setattr(reachability, "Reachability", lambda *a, **k: FakeReach(answers))
    monkeypatch.setattr(doctor_module, "REACH_WAIT", 1.5)
    from echo_p2p.net.network_config import NetworkConfig

    join = JoinAddress.parse(ADDRESS)
    doctor = Doctor(join, NetworkConfig(initial_peers=list(join.initial_peers)))
    if ok:
        assert text in doctor.this_machine()
    else:
        with pytest.raises(HopFailed, match=text):
            doctor.this_machine()
