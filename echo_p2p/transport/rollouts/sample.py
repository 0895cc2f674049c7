"""Inference side of the sequential pull (``--mode sync``): ``SampleServicer.rpc_sample``.

Owned here: ``SampleServicer`` (a hivemind ``ServicerBase``), ``SampleError`` (why a request was refused) and
``SampleFn``. A request is checked against the peer's tasks and limits; then the peer makes sure it holds the
requested policy version, holding no sampling slot meanwhile: a version that no trusted trainer announces
within ``version_grace`` (injected ``published_version``: one shared, cached read of the trusted policy
records) is refused as ``unknown_version``, and a published one is fetched (injected ``ensure_version``) in
a thread of its own, so that waiting for a version never blocks another requester's sampling. Only then
does the request take one of the ``max_concurrent`` sampling slots (injected ``sample``) and stream one
``SampleResponse`` per group. Each requester has at most one request in progress; at most
``max_concurrent + max_waiting`` are in progress in all. A bad request gets one response with a reason
(``SampleError``), is counted, and the peer keeps serving. Never raises. Callers: the inference peer
(``roles/inference.py``). Must not import torch;
blocking calls run in worker threads, never in the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind's ServicerBase needs typing's for streams

from hivemind.p2p import P2PContext

from echo_p2p.proto import rollouts_pb2
from echo_p2p.rollout import RolloutGroup
from echo_p2p.tasks.base import Task, TaskError
from echo_p2p.transport.rollouts.config import SampleServerConfig
from echo_p2p.transport.streams import LingeringServicer

logger = logging.getLogger(__name__)

#: A request's first look at the policy records reads them again when the last read is older than this (s).
_FRESH_READ = 0.05

#: ``sample(task, prompt_ids, n, version, max_new_tokens) -> list[RolloutGroup]`` (one group per prompt id).
SampleFn = Callable[[str, list[int], int, int, int], list[RolloutGroup]]


class SampleError(str, Enum):
    """Why an inference peer refused a sample request (sent back as ``SampleResponse.error``, counted)."""

    MALFORMED = "malformed"  # no prompts, negative version
    UNKNOWN_TASK = "unknown_task"
    BAD_PROMPT_ID = "bad_prompt_id"
    TOO_MANY_PROMPTS = "too_many_prompts"
    TOO_MANY_COMPLETIONS = "too_many_completions"
    TOO_MANY_TOKENS = "too_many_tokens"
    UNKNOWN_VERSION = (
        "unknown_version"  # no trusted trainer published it (or it could not be fetched in time)
    )
    NOT_ALLOWED = "not_allowed"  # the requester is not a peer this one samples for
    BUSY = "busy"  # too many requests in progress, or one of this requester's already is
    SAMPLE_FAILED = "sample_failed"  # sampling raised or timed out (logged)


Refusal = tuple[SampleError, str]


class SampleServicer(LingeringServicer):
    """Inference side of the sync pull (see the module doc).

    :param tasks: the tasks this peer samples, by name
    :param ensure_version: ``version -> bool``: hold ``version`` (fetching it if needed, blocking);
        False when no trusted trainer published it
    :param sample: ``SampleFn``; called only after ``ensure_version`` returned True
    :param is_allowed: ``peer_id -> bool``: whom to sample for (default: anyone)
    :param published_version: ``() -> int | None``: the newest version a trusted trainer announces (a
        bounded read of the policy records); None: none yet. Without it every version is fetched at once
        (``ensure_version`` alone decides).
    """

    def __init__(
        self,
        tasks: Mapping[str, Task],
        ensure_version: Callable[[int], bool],
        sample: SampleFn,
        config: SampleServerConfig | None = None,
        is_allowed: Callable[[str], bool] | None = None,
        published_version: Callable[[], int | None] | None = None,
    ) -> None:
        self.tasks = dict(tasks)
        self.ensure_version = ensure_version
        self.sample = sample
        self.config = config or SampleServerConfig()
        self.is_allowed = is_allowed
        self.published_version = published_version
        self.rejected: Counter[str] = Counter()
        self.served = 0
        self.groups_sent = 0
        self._active = 0
        self._requesters: set[str] = set()  # those with a request in progress (at most one each)
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(self.config.max_concurrent, thread_name_prefix="echo-sample")
        # one thread per request in progress: a slow fetch never delays a request whose version is held
        self._version_worker = ThreadPoolExecutor(
            self.config.max_concurrent + self.config.max_waiting, thread_name_prefix="echo-sample-version"
        )
        self._semaphore: asyncio.Semaphore | None = None
        self._published: tuple[float, int | None] = (-float("inf"), None)  # (monotonic read time, version)
        self._published_lock: asyncio.Lock | None = None

    async def rpc_sample(
        self, request: rollouts_pb2.SampleRequest, context: P2PContext
    ) -> AsyncIterator[rollouts_pb2.SampleResponse]:
        try:
            requester = context.remote_id.to_base58()
        except Exception:
            requester = "?"
        try:
            groups, error = await self._handle(request, requester)
        except Exception as exc:  # a bug: refuse this request, keep serving
            logger.exception("sample request from %s failed", requester)
            groups, error = [], (SampleError.SAMPLE_FAILED, type(exc).__name__)
        if error is not None:
            reason, detail = error
            with self._lock:
                self.rejected[reason.value] += 1
            logger.info("refused sample request from %s: %s (%s)", requester, reason.value, detail)
            yield rollouts_pb2.SampleResponse(error=reason.value, detail=detail[:256])
            return
        with self._lock:
            self.served += 1
        for payload in groups:
            with self._lock:
                self.groups_sent += 1
            yield rollouts_pb2.SampleResponse(group=payload)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"served": self.served, "groups_sent": self.groups_sent, "rejected": dict(self.rejected)}

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._version_worker.shutdown(wait=False, cancel_futures=True)

    # ---- internals ----------------------------------------------------------------------------------------
    def _check(self, request: rollouts_pb2.SampleRequest, requester: str) -> Refusal | None:
        config = self.config
        if self.is_allowed is not None and not self.is_allowed(requester):
            return SampleError.NOT_ALLOWED, "requester is not trusted"
        task = self.tasks.get(request.task)
        if task is None:
            return SampleError.UNKNOWN_TASK, f"task {request.task[:64]!r} is not served here"
        if not request.prompt_ids or request.policy_version < 0:
            return SampleError.MALFORMED, "no prompt ids or a negative version"
        if len(request.prompt_ids) > config.max_prompts_per_request:
            return (
                SampleError.TOO_MANY_PROMPTS,
                f"{len(request.prompt_ids)} > {config.max_prompts_per_request}",
            )
        if not 1 <= request.num_completions <= config.max_completions:
            return (
                SampleError.TOO_MANY_COMPLETIONS,
                f"{request.num_completions} not in [1, {config.max_completions}]",
            )
        if request.max_new_tokens > config.max_new_tokens:
            return SampleError.TOO_MANY_TOKENS, f"{request.max_new_tokens} > {config.max_new_tokens}"
        for prompt_id in request.prompt_ids:
            try:
                task.check_prompt_id(int(prompt_id))
            except TaskError as exc:
                return SampleError.BAD_PROMPT_ID, str(exc)
            if task.is_held_out(int(prompt_id)):
                return SampleError.BAD_PROMPT_ID, f"prompt {prompt_id} is held out for evaluation"
        return None

    async def _handle(
        self, request: rollouts_pb2.SampleRequest, requester: str
    ) -> tuple[list[bytes], Refusal | None]:
        error = self._check(request, requester)
        if error is not None:
            return [], error
        with self._lock:
            if requester in self._requesters:
                return [], (SampleError.BUSY, "one request at a time per requester")
            if self._active >= self.config.max_concurrent + self.config.max_waiting:
                return [], (SampleError.BUSY, f"{self._active} requests in progress")
            self._active += 1
            self._requesters.add(requester)
        try:
            error = await self._obtain_version(int(request.policy_version))  # no sampling slot held
            if error is not None:
                return [], error
            if self._semaphore is None:
                self._semaphore = asyncio.Semaphore(self.config.max_concurrent)
            async with self._semaphore:
                return await self._sample(request)
        finally:
            with self._lock:
                self._active -= 1
                self._requesters.discard(requester)

    async def _obtain_version(self, version: int) -> Refusal | None:
        """Hold ``version``: wait (≤ ``version_grace``) for a trusted trainer to announce it, then fetch it
        (≤ ``version_timeout``) in a version thread. None when held, else the refusal."""
        if self.published_version is not None:
            deadline = time.monotonic() + self.config.version_grace
            for look in itertools.count():
                # the first two looks (an instant apart) take only a very fresh shared read: in sync mode a
                # trainer asks for the version it published an instant ago, and waiting out the poll period
                # cost every step up to version_poll (0.5 s) of idle trainer
                period = min(_FRESH_READ, self.config.version_poll) if look < 2 else self.config.version_poll
                newest = await self._newest_published(deadline, version, period)
                if newest is not None and version <= newest:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return (
                        SampleError.UNKNOWN_VERSION,
                        f"no trusted trainer announces version {version} (newest: {newest})",
                    )
                await asyncio.sleep(min(period, left))
        loop = asyncio.get_running_loop()
        try:
            held = await asyncio.wait_for(
                loop.run_in_executor(self._version_worker, self.ensure_version, version),
                self.config.version_timeout,
            )
        except TimeoutError:
            return SampleError.UNKNOWN_VERSION, f"version {version} not obtained in time"
        except Exception as exc:
            logger.warning("getting version %d failed: %s", version, exc)
            return SampleError.UNKNOWN_VERSION, f"version {version} could not be obtained"
        if not held:
            return SampleError.UNKNOWN_VERSION, f"no trusted trainer published version {version}"
        return None

    async def _newest_published(self, deadline: float, wanted: int, max_age: float) -> int | None:
        """``published_version()``, shared by every waiting request (one read at a time, in a version
        thread): the last read is reused while it shows ``wanted`` or is under ``max_age`` s old (the poll
        period, or ``_FRESH_READ`` for a request's first looks, bounded by the requests: one at a time per
        trusted requester); the last value read when this read fails or the deadline passes."""
        if self._published_lock is None:
            self._published_lock = asyncio.Lock()
        try:
            return await asyncio.wait_for(
                self._read_published(wanted, max_age), max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            return self._published[1]
        except Exception as exc:
            logger.warning("reading the published versions failed: %s", exc)
            return self._published[1]

    async def _read_published(self, wanted: int, max_age: float) -> int | None:
        async with self._published_lock:
            read_at, newest = self._published
            if (newest is not None and wanted <= newest) or time.monotonic() - read_at < max_age:
                return newest
            loop = asyncio.get_running_loop()
            newest = await loop.run_in_executor(self._version_worker, self.published_version)
            self._published = (time.monotonic(), newest)
            return newest

    async def _sample(self, request: rollouts_pb2.SampleRequest) -> tuple[list[bytes], Refusal | None]:
        loop = asyncio.get_running_loop()
        version = int(request.policy_version)
        task = self.tasks[request.task]
        prompt_ids = [int(p) for p in request.prompt_ids]
        max_new_tokens = int(request.max_new_tokens) or task.max_new_tokens
        try:
            groups = await asyncio.wait_for(
                loop.run_in_executor(
                    self._worker,
                    self.sample,
                    request.task,
                    prompt_ids,
                    int(request.num_completions),
                    version,
                    max_new_tokens,
                ),
                self.config.sample_timeout,
            )
        except Exception as exc:
            logger.exception("sampling for a request failed")
            return [], (SampleError.SAMPLE_FAILED, type(exc).__name__)
        payloads = []
        for group in groups:
            if group.policy_version != version or group.task != request.task:
                logger.error("sample() returned a group of another version or task; not sent")
                continue
            payload = group.to_bytes()
            if len(payload) > self.config.max_group_bytes:
                logger.warning("group %s is %d bytes, too large to send", group.rollout_id, len(payload))
                continue
            payloads.append(payload)
        return payloads, None
