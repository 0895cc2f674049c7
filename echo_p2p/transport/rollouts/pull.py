"""Sequential pull of rollouts (``--mode sync``): a trainer asks inference peers for rollouts of given prompts.

Owned here: ``SampleClient`` (trainer): ``collect`` spreads a batch of prompts over the inference peers found
on the DHT, in proportion to their announced ``tokens_per_second`` (``spread_by_weight``), sends each peer
its share as requests of at most ``max_prompts_per_request`` prompts, one at a time (an inference peer
serves one request per requester at a time), within a deadline, and re-asks other peers for the prompts
that did not come back. Once some peers delivered, a few that never did are tried per round
(``max_unproven_per_round``), one prompt each, and dialled with a short deadline (``unproven_dial_timeout``):
keys are cheap, and a stranger's records of fast samplers at addresses where nobody answers would otherwise
get most prompts of every round and hold each round for a dial timeout. It
checks that what came back is what was asked (task, prompt, version, group
size); the trainer then validates it like any rollout (``guard.rollout_checks``). The inference side,
``SampleServicer`` and ``SampleError``, is ``rollouts.sample``. Callers: the trainer peer in sync mode.
Must not import torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import random
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import RolloutGroup
from echo_p2p.transport.p2p_loop import P2PLoop, peer_id_of
from echo_p2p.transport.rollouts.config import SampleClientConfig
from echo_p2p.transport.rollouts.sample import SampleServicer

__all__ = ["SampleClient", "spread_by_weight"]

logger = logging.getLogger(__name__)
#: Peers a sample client remembers as having delivered (the least recently delivering are forgotten).
MAX_PROVEN = 4096


# ---- trainer side -----------------------------------------------------------------------------------------
@dataclass
class _Peer:
    peer_id: str
    maddrs: list[str]
    tokens_per_second: float | None


def spread_by_weight(items: Sequence[int], weights: Mapping[str, float | None]) -> dict[str, list[int]]:
    """Split ``items`` over the keys of ``weights`` in proportion to the weights (largest remainder).

    A missing, zero or non-finite weight counts as the mean of the known ones (all unknown: equal shares).
    Keys that get nothing are left out. Order of ``items`` is kept within each share.
    """
    if not weights:
        return {}
    known = [w for w in weights.values() if w is not None and math.isfinite(w) and w > 0]
    default = sum(known) / len(known) if known else 1.0
    resolved = {
        k: (w if w is not None and math.isfinite(w) and w > 0 else default) for k, w in weights.items()
    }
    total = sum(resolved.values())
    quotas = {k: len(items) * w / total for k, w in resolved.items()}
    counts = {k: int(q) for k, q in quotas.items()}
    leftover = len(items) - sum(counts.values())
    for k in sorted(quotas, key=lambda k: (counts[k] - quotas[k], k))[:leftover]:
        counts[k] += 1
    out: dict[str, list[int]] = {}
    start = 0
    for k in weights:
        if counts[k]:
            out[k] = list(items[start : start + counts[k]])
            start += counts[k]
    return out


class SampleClient:
    """Trainer side of the sync pull (see the module doc). ``collect`` is synchronous, for one caller thread
    at a time (the training loop); its requests to several peers run concurrently in the ``P2PLoop``.

    :param directory: anything with ``peer_sample() -> list[Entry[PeerRecord]]`` (a ``SwarmDirectory``)
    :param accept: optional ``group -> bool`` run on each returned group (e.g. the trainer's validator);
        a group it refuses counts as not delivered and its prompt is asked again elsewhere
    :param is_banned: optional ``peer id -> bool``: banned peers are not asked (the trainer's ``SenderGuard``)
    :param stop: optional event (the trainer's stop): once set, ``collect`` returns what came so far within
        0.1 s instead of waiting out its deadline (``sync_timeout``, 60 s) with the inference peers gone

    Each group a peer returns is attributed to it (``sampler_peer_id``; a group naming another sampler is
    refused, ``not_the_sampler``), so the trainer's log-prob checks judge the peer that sampled it.
    """

    def __init__(
        self,
        loop: P2PLoop,
        directory,
        config: SampleClientConfig | None = None,
        namespace: str | None = None,
        accept: Callable[[RolloutGroup], bool] | None = None,
        is_banned: Callable[[str], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.loop = loop
        self.stop = stop or threading.Event()  # never set: collect runs to its deadline
        self.directory = directory
        self.config = config or SampleClientConfig()
        self.namespace = namespace
        self.accept = accept
        self.is_banned = is_banned
        self.counters: Counter[str] = Counter()  # requests, failed_requests, groups, reasked, unrequested
        self.refused: Counter[str] = Counter()  # reason -> requests refused by peers
        self._peers: list[_Peer] = []
        self._refreshed_at = -float("inf")
        self._bad_until: dict[str, float] = {}
        self._proven: OrderedDict[str, None] = OrderedDict()  # peers that delivered a group (bounded)

    def collect(
        self,
        task: str,
        prompt_ids: Sequence[int],
        n: int,
        version: int,
        timeout: float,
        max_new_tokens: int = 0,
    ) -> list[RolloutGroup]:
        """Rollout groups (``n`` completions each, sampled by ``version``) of ``prompt_ids``, one per entry,
        gathered within ``timeout`` seconds; fewer when the time runs out. Never raises on peer failures."""
        deadline = time.monotonic() + timeout
        needed: Counter[int] = Counter(int(p) for p in prompt_ids)
        out: list[RolloutGroup] = []
        failed: set[str] = set()  # peers that failed during this call
        first = True
        while +needed and (remaining := deadline - time.monotonic()) > 0:
            if self.stop.is_set():
                break  # the trainer is stopping: what came so far
            if not first:
                self.counters["reasked"] += sum(needed.values())
            first = False
            peers = self._candidates(failed)
            if not peers:
                self.stop.wait(min(self.config.idle_wait, remaining))
                failed.clear()  # nobody else: ask the failed ones again rather than nobody
                continue
            shares = self._shares(list(needed.elements()), peers)
            by_id = {p.peer_id: p for p in peers}
            request_timeout = min(self.config.request_timeout, remaining)
            try:
                results = self.loop.run(
                    self._round(shares, by_id, task, n, version, max_new_tokens, request_timeout),
                    timeout=request_timeout + 2.0,
                    stop=self.stop,
                )
            except concurrent.futures.CancelledError:  # the trainer is stopping: what came so far
                break
            except Exception as exc:  # the loop itself failed (shut down?): give up with what we have
                logger.warning("sample round failed: %s", exc)
                break
            for peer_id, (groups, error) in results.items():
                delivered = 0
                for group in groups:
                    if group.sampler_peer_id not in ("", peer_id):
                        self.counters["not_the_sampler"] += 1
                        continue
                    group.sampler_peer_id = peer_id  # whom the log-prob checks judge
                    if self._take(group, needed, task, n, version):
                        out.append(group)
                        delivered += 1
                if delivered:
                    self._proven[peer_id] = None
                    self._proven.move_to_end(peer_id)
                    while len(self._proven) > MAX_PROVEN:
                        self._proven.popitem(last=False)
                if error or delivered < len(shares[peer_id]):
                    failed.add(peer_id)
                    self._bad_until[peer_id] = time.monotonic() + self.config.retry_cooldown
                    self.counters["failed_requests"] += 1
                    logger.info(
                        "peer %s delivered %d of %d groups (%s)",
                        peer_id,
                        delivered,
                        len(shares[peer_id]),
                        error,
                    )
        return out

    def stats(self) -> dict[str, Any]:
        return {**dict(self.counters), "refused": dict(self.refused)}

    # ---- internals ----------------------------------------------------------------------------------------
    def _take(self, group: RolloutGroup, needed: Counter[int], task: str, n: int, version: int) -> bool:
        if (
            needed[group.prompt_id] <= 0
            or group.task != task
            or group.policy_version != version
            or group.group_size != n
        ):
            self.counters["unrequested"] += 1
            return False
        if self.accept is not None:
            try:
                if not self.accept(group):
                    self.counters["not_accepted"] += 1
                    return False
            except Exception:
                logger.exception("accept() raised")
                return False
        needed[group.prompt_id] -= 1
        self.counters["groups"] += 1
        return True

    def _candidates(self, failed: set[str]) -> list[_Peer]:
        if time.monotonic() - self._refreshed_at >= self.config.refresh_period:
            self._refresh()
        now = time.monotonic()
        usable = [
            p
            for p in self._peers
            if p.peer_id not in failed and not (self.is_banned is not None and self.is_banned(p.peer_id))
        ]
        fresh = [p for p in usable if self._bad_until.get(p.peer_id, 0.0) <= now]
        pool = fresh or usable
        unproven = [p for p in pool if p.peer_id not in self._proven]
        if len(unproven) > self.config.max_unproven_per_round:  # a Sybil's records: only a few are tried
            unproven = random.sample(unproven, self.config.max_unproven_per_round)
        return [p for p in pool if p.peer_id in self._proven] + unproven

    def _shares(self, items: list[int], peers: list[_Peer]) -> dict[str, list[int]]:
        """Who is asked for what: by announced speed among the peers that delivered before; a peer that never
        did gets one prompt to show it can (all of them by speed when none has delivered yet)."""
        proven = [p for p in peers if p.peer_id in self._proven]
        unproven = [p for p in peers if p.peer_id not in self._proven]
        if not proven:
            return spread_by_weight(items, {p.peer_id: p.tokens_per_second for p in unproven})
        explore = items[: len(unproven)] if len(items) > len(unproven) else []
        shares = spread_by_weight(items[len(explore) :], {p.peer_id: p.tokens_per_second for p in proven})
        for peer, item in zip(unproven, explore, strict=False):  # none explored when prompts are few
            shares[peer.peer_id] = [item]
        return shares

    def _refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        try:
            entries = self.directory.peer_sample()  # its bucket and a random one: O(N/K) records
        except Exception as exc:
            logger.info("reading the inference peer list failed: %s", exc)
            return
        own = self.loop.peer_id if self.loop.p2p is not None else None
        peers: dict[str, _Peer] = {}
        for entry in entries:
            record = entry.record
            if record.role != "inference" or record.state != "running" or record.mode == "async":
                continue
            if record.peer_id != own and record.peer_id not in peers:
                peers[record.peer_id] = _Peer(record.peer_id, list(record.maddrs), record.tokens_per_second)
        self._peers = list(peers.values())

    async def _round(
        self,
        shares: dict[str, list[int]],
        peers: dict[str, _Peer],
        task: str,
        n: int,
        version: int,
        max_new_tokens: int,
        timeout: float,
    ) -> dict[str, tuple[list[RolloutGroup], str]]:
        deadline = time.monotonic() + timeout

        async def ask_peer(peer: _Peer, prompt_ids: list[int]) -> tuple[list[RolloutGroup], str]:
            """The peer's share, one request at a time (it serves one per requester at once)."""
            step = self.config.max_prompts_per_request
            groups: list[RolloutGroup] = []
            for i in range(0, len(prompt_ids), step):
                left = deadline - time.monotonic()
                if left <= 0:
                    return groups, f"no complete answer within {timeout:.1f} s"
                got, error = await self._ask(
                    peer, task, prompt_ids[i : i + step], n, version, max_new_tokens, left
                )
                groups += got
                if error:
                    return groups, error
            return groups, ""

        pairs = list(shares.items())
        results = await asyncio.gather(*(ask_peer(peers[pid], ids) for pid, ids in pairs))
        return {pid: result for (pid, _), result in zip(pairs, results, strict=True)}

    async def _ask(
        self,
        peer: _Peer,
        task: str,
        prompt_ids: list[int],
        n: int,
        version: int,
        max_new_tokens: int,
        timeout: float,
    ) -> tuple[list[RolloutGroup], str]:
        request = rollouts_pb2.SampleRequest(
            task=task,
            prompt_ids=prompt_ids,
            num_completions=n,
            max_new_tokens=max_new_tokens,
            policy_version=version,
            request_id=uuid.uuid4().hex,
        )
        self.counters["requests"] += 1
        groups: list[RolloutGroup] = []
        stream = None
        try:
            async with asyncio.timeout(timeout):
                dial = timeout / 2
                if peer.peer_id not in self._proven:
                    dial = min(dial, self.config.unproven_dial_timeout)
                await self.loop.dial(peer.peer_id, peer.maddrs, timeout=dial)
                stub = SampleServicer.get_stub(
                    self.loop.p2p, peer_id_of(peer.peer_id), namespace=self.namespace
                )
                stream = await stub.rpc_sample(request)
                async for response in stream:
                    if response.error:
                        self.refused[response.error[:64]] += 1
                        return groups, f"refused: {response.error} ({response.detail})"
                    if len(response.group) > self.config.max_group_bytes:
                        return groups, "a group above the size limit"
                    try:
                        groups.append(RolloutGroup.from_bytes(response.group))
                    except ValueError:
                        return groups, "a malformed group"
                    if len(groups) >= len(prompt_ids):
                        break
            return groups, ""
        except TimeoutError:
            return groups, f"no complete answer within {timeout:.1f} s"
        except Exception as exc:
            self.loop.forget(peer.peer_id)
            return groups, f"{type(exc).__name__}: {exc}"
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(stream.aclose(), 1.0)
