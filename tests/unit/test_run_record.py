"""The run owner's signed run record, the join address and ``RunTrust`` (no network)."""

from __future__ import annotations

import time

import pytest

from echo_p2p.guard.trust import RunTrust, TrustedTrainers
from echo_p2p.net import run_record as rr
from echo_p2p.net.identity import load_or_create_identity
from echo_p2p.net.records import SignedRunRecord


@pytest.fixture(scope="module")
def people():
    ids = {name: load_or_create_identity(None) for name in ("owner", "stranger", "t1", "t2")}
    yield ids
    for ident in ids.values():
        ident.cleanup()


def make(people, serial=1, trainers=("t1",), run_id="r1", valid=3600.0, owner="owner"):
    now = time.time()
    record = rr.RunRecord(
        run_id=run_id,
        owner_key=people[owner].public_key_bytes().decode(),
        trainers=[people[t].peer_id for t in trainers],
        serial=serial,
        issued_at=now,
        expires_at=now + valid,
        model="tiny",
        task="count",
        mode="async",
    )
    record_bytes, signature = rr.sign(record, people[owner])
    return SignedRunRecord(peer_id=people["t1"].peer_id, record=record_bytes, signature=signature)


def test_a_record_verifies_only_for_its_owner_run_and_bytes(people):
    owner = people["owner"].peer_id
    signed = make(people)
    record = rr.verify(signed.record, signed.signature, "r1", owner)
    assert isinstance(record, rr.RunRecord) and record.trainers == [people["t1"].peer_id]
    assert rr.verify(signed.record, signed.signature, "r1", people["stranger"].peer_id) == rr.WRONG_OWNER
    assert rr.verify(signed.record, signed.signature, "other", owner) == rr.WRONG_RUN
    tampered = signed.record.replace(b"tiny", b"huge")
    assert rr.verify(tampered, signed.signature, "r1", owner) == rr.BAD_SIGNATURE
    assert rr.verify(signed.record, signed.signature[:-1] + b"\0", "r1", owner) == rr.BAD_SIGNATURE
    assert rr.verify(b"\xc1garbage", signed.signature, "r1", owner) == rr.MALFORMED
    assert rr.verify(b"x" * (rr.MAX_RECORD_BYTES + 1), b"", "r1", owner) == rr.MALFORMED
    # a stranger's record naming itself owner: right signature, wrong owner for this run
    forged = make(people, owner="stranger", trainers=("stranger",))
    assert rr.verify(forged.record, forged.signature, "r1", owner) == rr.WRONG_OWNER
    expired = make(people, valid=-1.0)
    assert rr.verify(expired.record, expired.signature, "r1", owner) == rr.EXPIRED
    with pytest.raises(ValueError):
        rr.sign(rr.verify(signed.record, signed.signature, "r1", owner), people["stranger"])


def test_a_record_carries_the_directorys_k_and_one_without_it_keeps_its_old_bytes(people):
    signed = make(people)
    record = rr.verify(signed.record, signed.signature, "r1", people["owner"].peer_id)
    assert record.directory_buckets is None and b"directory_buckets" not in record.to_bytes()
    sharded = record.model_copy(update={"directory_buckets": 64})
    record_bytes, signature = rr.sign(sharded, people["owner"])
    assert rr.verify(record_bytes, signature, "r1", people["owner"].peer_id).directory_buckets == 64
    with pytest.raises(ValueError):
        rr.RunRecord.model_validate({**record.model_dump(), "directory_buckets": 3})


def test_run_trust_follows_the_newest_valid_record_and_ignores_forgeries(people):
    owner = people["owner"].peer_id
    t1, t2, stranger = (people[n].peer_id for n in ("t1", "t2", "stranger"))
    trust = RunTrust(owner=owner, run_id="r1")
    assert trust.configured and not trust.is_trusted(t1)  # no record yet: nobody
    forged = make(people, serial=99, owner="stranger", trainers=("stranger",))
    assert trust.update([forged, make(people, serial=1)])
    assert trust.is_trusted(t1) and not trust.is_trusted(stranger) and not trust.is_trusted(t2)
    assert trust.refused == {rr.WRONG_OWNER: 1}
    # a newer serial adds a trainer; an older one is never applied again
    assert trust.update([make(people, serial=2, trainers=("t1", "t2"))])
    assert trust.is_trusted(t2)
    assert not trust.update([make(people, serial=1)])
    assert trust.is_trusted(t2) and trust.record.serial == 2


def test_unconfigured_trust_takes_everyone_and_a_file_only_its_lines(people):
    assert RunTrust().is_trusted(people["stranger"].peer_id) and not RunTrust().configured
    fixed = RunTrust(fixed=TrustedTrainers.from_keys([people["t1"].peer_id]))
    assert fixed.is_trusted(people["t1"].peer_id) and not fixed.is_trusted(people["stranger"].peer_id)


def test_join_address_round_trip_and_refusals(people):
    owner = people["owner"].peer_id
    maddrs = ("/ip4/10.0.0.1/tcp/31337/p2p/QmBoot", "/dns/boot.example.org/tcp/31337/p2p/QmBoot2")
    text = f"run-7:{owner}@{','.join(maddrs)}"
    join = rr.JoinAddress.parse(text)
    assert (join.run_id, join.owner, join.initial_peers) == ("run-7", owner, maddrs)
    assert str(join) == text
    for bad in (
        f"run-7@{maddrs[0]}",  # no owner
        f"run-7:{owner}",  # no multiaddr
        f"run-7:{owner}@ip4/1.2.3.4",  # not a multiaddr
        f"bad run:{owner}@{maddrs[0]}",  # not a run id
        f"run-7:not-a-peer-id@{maddrs[0]}",
    ):
        with pytest.raises(ValueError):
            rr.JoinAddress.parse(bad)


def test_record_file_round_trip_and_refusal(people, tmp_path):
    signed = make(people)
    path = tmp_path / "run.record"
    rr.write_file(path, signed.record, signed.signature)
    record, record_bytes, signature = rr.read_file(path)
    assert record.run_id == "r1" and record_bytes == signed.record and signature == signed.signature
    rr.write_file(path, signed.record, b"\0" * 256)
    with pytest.raises(ValueError, match="bad_signature"):
        rr.read_file(path)
    path.write_bytes(b"not msgpack")
    with pytest.raises(ValueError, match="not a signed run record"):
        rr.read_file(path)


def test_owner_cli_signs_a_record_of_a_trainers_file_and_shows_it(people, tmp_path, capsys):
    from echo_p2p import owner as cli
    from echo_p2p.guard.trust import trainer_key_line

    trainers = tmp_path / "trainers.txt"
    trainers.write_text(trainer_key_line(people["t1"]) + "\n" + people["t2"].peer_id + "\n")
    out = tmp_path / "demo.record"
    owner_id = tmp_path / "owner.id"
    cli.main(
        ["sign", "--owner-identity", str(owner_id), "--run-id", "demo", "--trainers", str(trainers)]
        + ["--model", "tiny", "--task", "count", "--mode", "async", "--serial", "7", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    record, _, _ = rr.read_file(out)
    assert record.serial == 7 and set(record.trainers) == {people["t1"].peer_id, people["t2"].peer_id}
    assert f"join address: demo:{record.owner_peer_id()}@" in printed
    cli.main(["show", str(out)])
    assert '"serial": 7' in capsys.readouterr().out
    assert record.directory_buckets is None  # no size given: one directory bucket
    sharded = tmp_path / "big.record"
    cli.main(
        ["sign", "--owner-identity", str(owner_id), "--run-id", "demo", "--trainers", str(trainers)]
        + ["--expected-peers", "5000", "--out", str(sharded)]
    )
    assert rr.read_file(sharded)[0].directory_buckets == 256  # 64 buckets would hold 80 peers each
    with pytest.raises(SystemExit):
        cli.main(
            [
                "sign",
                "--owner-identity",
                str(owner_id),
                "--run-id",
                "bad run",
                "--trainers",
                str(trainers),
                "--out",
                str(out),
            ]
        )


def test_a_missing_record_is_explained_with_what_was_found_and_the_fix(people):
    """A peer that finds no valid record says why: nothing under the run id, a record signed by another
    owner (named), an expired one (with its date), one altered or not signed by its key."""
    owner, stranger = people["owner"].peer_id, people["stranger"].peer_id
    assert "no run named 'r1' on this bootstrap" in rr.explain_missing([], "r1", owner)
    text = rr.explain_missing([make(people)], "r1", stranger)
    assert f"the run's record is signed by {owner}, not by the owner {stranger} of your address" in text
    expired = make(people, valid=-60.0)
    text = rr.explain_missing([expired], "r1", owner)
    assert "the run record of 'r1' expired at" in text and "owner init again, or owner sign" in text
    signed = make(people)
    altered = SignedRunRecord(peer_id=signed.peer_id, record=signed.record, signature=b"\0" * 256)
    assert "is not validly signed by" in rr.explain_missing([altered], "r1", owner)
    assert "bad_signature" in rr.explain_missing([altered], "r1", owner)
    garbage = SignedRunRecord(peer_id=signed.peer_id, record=b"\xc1", signature=b"x")
    assert "malformed" in rr.explain_missing([garbage], "r1", owner)
    # a valid record older than the serial the join address names (a stale or eclipsing bootstrap)
    text = rr.explain_missing([make(people, serial=3)], "r1", owner, min_serial=5)
    assert "found has serial 3, older than the serial 5 your address names" in text
    # a stranger's copy next to the owner's expired one: the stranger is named first (the address is wrong)
    assert "signed by" in rr.explain_missing([expired, make(people, owner="stranger")], "r1", owner)


def test_an_expired_record_file_is_refused_with_its_date_and_the_fix(people, tmp_path):
    now = time.time()
    record = rr.RunRecord(
        run_id="r1", owner_key=people["owner"].public_key_bytes().decode(), trainers=[people["t1"].peer_id],
        serial=1, issued_at=now - 100, expires_at=now - 50,
    )  # fmt: skip
    rr.write_file(tmp_path / "old.record", *rr.sign(record, people["owner"]))
    with pytest.raises(ValueError, match="expired at .* the owner signs a new one"):
        rr.read_file(tmp_path / "old.record")
    rr.write_file(tmp_path / "unsigned.record", record.to_bytes(), b"")
    with pytest.raises(ValueError, match="refused: bad_signature .*not signed by its owner key"):
        rr.read_file(tmp_path / "unsigned.record")


def test_a_run_record_older_than_the_join_addresss_is_refused(people):
    """Run-record rollback, found by an attacker: a stranger's DHT node serving only the owner's older record
    (naming a trainer since removed) made a fresh reader trust that trainer again. A join address now names
    the serial in force when it was made, and a peer joining with it refuses any older record."""
    owner = people["owner"].peer_id
    maddr = "/ip4/127.0.0.1/tcp/31337/p2p/QmBoot"
    join = rr.JoinAddress.parse(f"r1:{owner}@{maddr}#3")
    assert join.min_serial == 3 and str(join) == f"r1:{owner}@{maddr}#3"
    assert rr.JoinAddress.parse(f"r1:{owner}@{maddr}").min_serial == 0  # old addresses still parse
    for bad in ("#", "#-1", "#x", "#1.5", f"#{2**63}", "#" + "9" * 40):
        with pytest.raises(ValueError):
            rr.JoinAddress.parse(f"r1:{owner}@{maddr}{bad}")
    trust = RunTrust(owner=owner, run_id="r1", min_serial=join.min_serial)
    old = make(people, serial=2, trainers=("stranger",))  # the eclipse serves only the older record
    assert not trust.update([old]) and trust.record is None
    assert not trust.is_trusted(people["stranger"].peer_id)
    assert trust.refused == {rr.OLDER_THAN_KNOWN: 1}
    assert trust.update([old, make(people, serial=3, trainers=("t1",))])  # the one it names is taken
    assert trust.is_trusted(people["t1"].peer_id) and not trust.is_trusted(people["stranger"].peer_id)


def test_a_join_addresss_serial_reaches_the_peers_trust(people):
    from echo_p2p.peer import parse_config

    owner = people["owner"].peer_id
    config = parse_config(
        ["--role", "inference", "--join", f"r1:{owner}@/ip4/127.0.0.1/tcp/1/p2p/QmBoot#5"], {}
    )
    assert config.run_record_serial == 5 and config.run_owner == owner
