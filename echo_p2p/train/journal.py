"""Intake journal of a trainer peer: every rollout group it acknowledged, on disk until it is used.

Owned here: ``IntakeJournal``. An async trainer acknowledges a pushed group once it is in its replay buffer;
the pusher then forgets it. Without a journal, a trainer killed at that point takes every acknowledged,
unused group with it. With one, ``ReplayBuffer.add`` appends the group (and the rewards the trainer
computed) before the acknowledgement is sent, and the group is *settled* when it leaves the buffer unused
(evicted, dropped as stale, its sender banned) or when the trainer has used it in a version (the epoch its
gradient went into advanced). A trainer restarted with ``--resume`` reads the journal back and puts the
unsettled groups in its buffer again (those too stale by then are counted, not used).

File format (``<checkpoint_dir>/intake.journal``): a sequence of records ``[u32 length][u32 crc32][u8 kind]
[payload]`` (big-endian; length and crc cover kind and payload). Kind ``A`` (added): ``[u32 header length]
[header: JSON {"rewards": [...]}][RolloutGroup.to_bytes()]``; kind ``S`` (settled): rollout ids joined by
newlines. A torn or corrupt tail (a crash in the middle of a write) ends the journal there and is cut off.
Every record is one ``write`` on an unbuffered file: it survives the death of the process as soon as the
call returns (``fsync=True`` also survives the machine's). The file is rewritten with only the live records
when it grows past ``compact_bytes`` and four times what is live.

Called by ``train.buffer.ReplayBuffer`` (``added``, ``settled``) and the trainer peer (``settled`` after a
version, ``recover``). Pure Python: no torch, no hivemind. The file is the trainer's own
(like its checkpoints): what it reads back is trusted.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from echo_p2p.rollout import RolloutGroup
from echo_p2p.train.scored import ScoredGroup

logger = logging.getLogger(__name__)

JOURNAL_NAME = "intake.journal"
_HEAD = struct.Struct(">II")
_U32 = struct.Struct(">I")
ADDED, SETTLED = b"A", b"S"
#: Largest record read back (a group is bounded by the ingest's max_group_bytes, far below this).
MAX_RECORD = 64 << 20


@dataclass
class _Live:
    offset: int  # of the record's header in the file
    length: int  # of the whole record
    policy_version: int


@dataclass
class JournalStats:
    appended: int = 0
    settled: int = 0
    compactions: int = 0
    live: int = 0
    file_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _record(kind: bytes, payload: bytes) -> bytes:
    body = kind + payload
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _encode_added(scored: ScoredGroup) -> bytes:
    header = json.dumps({"rewards": list(scored.rewards)}).encode()
    return _record(ADDED, _U32.pack(len(header)) + header + scored.group.to_bytes())


def _decode_added(payload: bytes) -> ScoredGroup:
    (n,) = _U32.unpack_from(payload)
    header = json.loads(payload[4 : 4 + n])
    return ScoredGroup(RolloutGroup.from_bytes(payload[4 + n :]), header["rewards"])


class IntakeJournal:
    """Acknowledged, unused rollout groups on disk (see the module doc).

    :param path: the journal file (created; an existing one is read by ``recover`` or replaced by ``open``)
    :param fsync: also ``fsync`` after every record (survives a power loss, costs a disk flush per push)
    :param compact_bytes: the file is never rewritten below this size
    """

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, compact_bytes: int = 8 << 20) -> None:
        self.path = os.fspath(path)
        self.fsync = fsync
        self.compact_bytes = compact_bytes
        self.stats = JournalStats()
        self._live: dict[str, _Live] = {}
        self._live_bytes = 0  # sum of the live records' lengths
        self._lock = threading.Lock()
        self._file = None
        self._size = 0

    # ---- opening ---------------------------------------------------------------------------------------
    def recover(self) -> list[ScoredGroup]:
        """Read an existing journal back: the groups added and never settled, in the order they came. The
        file is then rewritten with just those, and the journal is open for appending."""
        groups: dict[str, ScoredGroup] = {}
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                data = f.read()
            pos, bad = 0, None
            while pos < len(data):
                if len(data) - pos < 9:
                    bad = "a torn record header"
                    break
                length, crc = _HEAD.unpack_from(data, pos)
                body = data[pos + 8 : pos + 8 + length]
                if length < 1 or length > MAX_RECORD or len(body) < length:
                    bad = "a torn record"
                    break
                if zlib.crc32(body) != crc:
                    bad = "a record whose checksum does not match"
                    break
                kind, payload = body[:1], body[1:]
                try:
                    if kind == ADDED:
                        scored = _decode_added(payload)
                        groups[scored.rollout_id] = scored
                    elif kind == SETTLED:
                        for rid in payload.decode().split("\n"):
                            groups.pop(rid, None)
                except Exception as exc:  # a record we wrote but cannot read: skip it, keep the rest
                    logger.warning("intake journal %s: unreadable record skipped (%s)", self.path, exc)
                pos += 8 + length
            if bad is not None:
                logger.warning(
                    "intake journal %s ends in %s at byte %d of %d: cut there", self.path, bad, pos, len(data)
                )
        self._rewrite(list(groups.values()))
        return list(groups.values())

    def open(self) -> IntakeJournal:
        """Start an empty journal (a trainer that does not resume: what an older journal held is dropped)."""
        self._rewrite([])
        return self

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    # ---- records ---------------------------------------------------------------------------------------
    def added(self, scored: ScoredGroup) -> None:
        """A group went into the buffer (called before it is acknowledged)."""
        record = _encode_added(scored)
        with self._lock:
            if self._file is None:
                return
            offset = self._append(record)
            old = self._live.pop(scored.rollout_id, None)
            self._live_bytes += len(record) - (old.length if old else 0)
            self._live[scored.rollout_id] = _Live(offset, len(record), scored.policy_version)
            self.stats.appended += 1
            self._maybe_compact()

    def settled(self, rollout_ids: Iterable[str]) -> None:
        """These groups are gone for good (used in a version, evicted, dropped, banned): never re-loaded."""
        with self._lock:
            if self._file is None:
                return
            ids = [rid for rid in rollout_ids if rid in self._live]
            if not ids:
                return
            self._append(_record(SETTLED, "\n".join(ids).encode()))
            for rid in ids:
                self._live_bytes -= self._live.pop(rid).length
            self.stats.settled += len(ids)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            self.stats.live = len(self._live)
            self.stats.file_bytes = self._size
            return self.stats.as_dict()

    # ---- internals -------------------------------------------------------------------------------------
    def _append(self, record: bytes) -> int:
        offset = self._size
        self._file.write(record)  # unbuffered: one write(2), in the kernel when it returns
        if self.fsync:
            os.fsync(self._file.fileno())
        self._size += len(record)
        return offset

    def _maybe_compact(self) -> None:
        if self._size < self.compact_bytes or self._size < 4 * self._live_bytes:
            return
        with open(self.path, "rb") as f:
            records = []
            for e in sorted(self._live.values(), key=lambda e: e.offset):
                f.seek(e.offset)
                records.append(f.read(e.length))
        self._file.close()
        self._write_file(records)
        self.stats.compactions += 1

    def _rewrite(self, groups: list[ScoredGroup]) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._live.clear()
            records = [_encode_added(g) for g in groups]
            self._write_file(records, groups)

    def _write_file(self, records: list[bytes], groups: list[ScoredGroup] | None = None) -> None:
        """Replace the file by ``records`` (atomically: a crash leaves the old file or the new one)."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        offsets, pos = [], 0
        for r in records:
            offsets.append(pos)
            pos += len(r)
        if groups is not None:  # a fresh file: index it
            self._live = {
                g.rollout_id: _Live(o, len(r), g.policy_version)
                for g, o, r in zip(groups, offsets, records, strict=True)
            }
        else:  # a compaction keeps the live records in offset order: re-index them in that order
            order = sorted(self._live.items(), key=lambda kv: kv[1].offset)
            self._live = {
                rid: _Live(o, e.length, e.policy_version) for (rid, e), o in zip(order, offsets, strict=True)
            }
        self._size = self._live_bytes = pos
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held open for appends
