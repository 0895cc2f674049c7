"""The inference peer: holds a policy version, samples and scores rollouts, sends them to trainers.

Owned here: wiring the pure-ML layer (model, engine, task) to the network for one inference peer — the
weight fetcher (trusted trainers' versions only, applied atomically, served on to other peers), and either
the async push loop (sample continuously with the newest version, push version-tagged groups to the
trainer with the most room, never pile up) or the sync sample RPC (a trainer names prompts and a version;
the peer updates to it first, then samples). The engine's version and the version written into every
rollout change together, under one lock: a group is never tagged with a version that did not sample it.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

from echo_p2p.roles.base import BasePeer

logger = logging.getLogger(__name__)

#: Providers whose byte counts a metrics line lists (the largest first); the rest are only counted.
MAX_PROVIDERS_REPORTED = 8


class InferencePeer(BasePeer):
    role = "inference"

    def __init__(self, config, identity=None):
        super().__init__(config, identity)
        self.section = config.inference
        self.tokens_per_second: float | None = None
        self.rollouts_per_second: float | None = None
        self.groups_sampled = 0
        self.tokens_sampled = 0
        self.sampling_seconds = 0.0
        #: seconds in ``_load``: waiting for the engine (a sampling round holds it) and putting a version in
        self.loading_seconds = 0.0
        self.weights_wait_seconds = 0.0
        self.room_wait_seconds = 0.0
        self.engine = None
        self.sampling = None  # rollout.Sampling: how this peer samples, written into every group
        self.fetcher = None
        self.pusher = None
        self.loop = None
        self.sample_server = None
        self._engine_lock = threading.Lock()  # engine weights + self.policy_version change together
        self.weights_stream = ""  # the publisher stream of the held version's weights (RolloutGroup's)
        self._new_version = threading.Condition()  # notified when a newer version is in the engine
        self.stale_waits = 0  # times sampling waited because the trainers refused this version as too stale
        self._rng = random.Random(config.seed)
        self._started_work = time.monotonic()
        #: Progress callback of weight fetches (the CLI sets a bar / log reporter); None: silent.
        self.on_weights_progress = None
        self.waiting_for_grants: float | None = None  # recent share of time waiting for a grant (announced)
        # (monotonic, pusher.seconds_paced) at the last look
        self._paced_mark: tuple[float, float] | None = None
        self._newest_known: int | None = None  # newest version a trainer's ack reported (async)
        deadline = config.watchdog.work_deadline
        self.watchdog.watch("sampling", deadline, due=self._sampling_due)
        self.watchdog.watch("version", deadline, due=self._version_due)

    # ---- setup ------------------------------------------------------------------------------------------
    def on_start(self) -> None:
        from echo_p2p.ml.models import load_policy
        from echo_p2p.ml.tokenizer import check_chat_template
        from echo_p2p.tasks.registry import build_task
        from echo_p2p.transport.p2p_loop import P2PLoop
        from echo_p2p.transport.rollouts.config import rollout_namespace
        from echo_p2p.transport.weights.fetch.config import FetcherConfig
        from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher

        run, section = self.config.run, self.section
        if self.config.threads:
            import torch

            torch.set_num_threads(self.config.threads)
        self.task = build_task(run.task, run.task_options)
        self.params = run.sampling_params(self.task.max_new_tokens)
        precision = run.sampler_precision()
        if section.engine == "vllm":
            precision = section.vllm.dtype or precision  # vLLM takes no bitsandbytes weights
        if run.sampler_precisions is not None and precision not in run.sampler_precisions:
            raise ValueError(
                f"this peer samples with {precision} weights; the run accepts rollouts of "
                f"{', '.join(run.sampler_precisions)} samplers only"
            )
        self.sampling = run.sampling(section.engine, precision)
        if section.engine == "vllm" and run.seeded_sampling:
            raise ValueError(
                "the run checks seeded draws (run.seeded_sampling) and the vLLM engine does not draw from a "
                "seed: sample with --engine transformers, or join a run whose owner set seeded_sampling false"
            )
        if section.engine == "vllm":
            from echo_p2p.ml.engine_vllm import VllmEngine

            self.engine = VllmEngine(run.model, section.vllm)
            self.tokenizer = self.engine.tokenizer
        else:
            from echo_p2p.ml.engine import TransformersEngine

            model, self.tokenizer = load_policy(run.model)
            self.engine = TransformersEngine(model, self.tokenizer)
        check_chat_template(self.tokenizer, self.task.conversational, run.model.use_chat_template)
        self.fetcher = WeightFetcher(
            self.dht,
            self.identity,
            self.keys,
            self.trust,
            FetcherConfig(serve=section.serve_weights, poll_period=section.weights_poll_period),
            on_progress=self.on_weights_progress,
            reach=self.reach,
        ).start()
        self.loop = P2PLoop.from_dht(self.dht)
        namespace = rollout_namespace(self.keys)
        if self.config.mode == "async":
            from echo_p2p.transport.rollouts.push import RolloutPusher

            self.pusher = RolloutPusher(
                self.loop, self.directory, section.pusher, namespace, is_trusted=self.trust.is_trusted
            )
            self.pusher.on_trainer_version = self._on_trainer_version
            self.pusher.start()
            self.fetcher.follow(on_update=self._load)
        else:
            from echo_p2p.transport.rollouts.sample import SampleServicer

            self.sample_server = SampleServicer(
                {self.task.name: self.task},
                self._ensure_version,
                self._sample_for_request,
                section.sample_server,
                is_allowed=self.trust.is_trusted,  # only the run's trainers may ask for samples
                published_version=self.fetcher.published_version,
            )
            self.loop.add_servicer(self.sample_server, namespace)

    def _load(self, weights) -> None:
        """Put a newly fetched version into the engine (called by the fetcher's follower thread)."""
        tensors = weights.tensors
        t0 = time.monotonic()
        try:
            with self._engine_lock:
                if self.policy_version is not None and weights.version <= self.policy_version:
                    return
                if weights.changed is not None and weights.changed_since == self.policy_version:
                    self.engine.update_weights(tensors, weights.changed)  # only what the patches changed
                else:
                    self.engine.load_weights(tensors)
                first = self.policy_version is None
                self.policy_version = weights.version
                self.weights_stream = weights.stream_id
        finally:
            self.loading_seconds += time.monotonic() - t0
        self.watchdog.beat("version")
        with self._new_version:
            self._new_version.notify_all()
        # the fetcher logs the versions applied (a few lines a minute); the first one is a milestone
        log = logger.info if first else logger.debug
        log("%s now samples with policy version %d", self.prefix(), weights.version)

    def _ensure_version(self, version: int) -> bool:
        """Sync mode: hold ``version`` (fetching it if needed) before sampling; False if nobody published it."""
        t0 = time.monotonic()
        try:
            if self.policy_version is None or self.policy_version < version:
                weights = self.fetcher.ensure_version(
                    version, timeout=self.section.sample_server.version_timeout
                )
                self._load(weights)
        except TimeoutError:
            return False
        finally:
            self.weights_wait_seconds += time.monotonic() - t0
        return self.policy_version == version

    # ---- sampling -----------------------------------------------------------------------------------
    def _sample(self, prompt_ids: list[int], n: int, max_new_tokens: int | None = None) -> list:
        """Sample ``n`` completions of each prompt with the held version, score them, build groups."""
        from echo_p2p.ml.tokenizer import decode_completion, encode_prompts
        from echo_p2p.rollout import Completion, RolloutGroup

        run = self.config.run
        texts = [self.task.prompt(i) for i in prompt_ids]
        prompts = encode_prompts(self.tokenizer, texts, run.model.use_chat_template)
        params = self.params
        if max_new_tokens:
            params = params.model_copy(update={"max_new_tokens": max_new_tokens})
        t0 = time.monotonic()
        with self._engine_lock:
            version, stream = self.policy_version, self.weights_stream
            samples = self.engine.sample(prompts, n, params)
        elapsed = time.monotonic() - t0
        groups = []
        for prompt_id, prompt, outs in zip(prompt_ids, prompts, samples, strict=True):
            completions_text = [decode_completion(self.tokenizer, s.token_ids) for s in outs]
            rewards = self.task.score_batch(
                [prompt_id] * len(outs), completions_text, completion_ids=[s.token_ids for s in outs]
            )
            groups.append(
                RolloutGroup(
                    task=self.task.name,
                    prompt_id=prompt_id,
                    prompt_token_ids=prompt,
                    completions=[
                        Completion(
                            token_ids=s.token_ids, logprobs=s.logprobs, claimed_reward=r, finished=s.finished
                        )
                        for s, r in zip(outs, rewards, strict=True)
                    ],
                    policy_version=version,
                    weights_stream=stream,
                    sampler_peer_id=self.peer_id,
                    sampled_at=time.time(),
                    sampling_seed=outs[0].seed if outs else "",
                    sampling=self.sampling,
                )
            )
        tokens = sum(len(s.token_ids) for outs in samples for s in outs)
        self.tokens_sampled += tokens
        self.sampling_seconds += elapsed
        self.groups_sampled += len(groups)
        self.tokens_per_second = round(self.tokens_sampled / max(1e-9, self.sampling_seconds), 1)
        self.rollouts_per_second = round(
            self.groups_sampled / max(1e-9, time.monotonic() - self._started_work), 3
        )
        return groups

    def _sample_for_request(
        self, task: str, prompt_ids: list[int], n: int, version: int, max_new_tokens: int
    ) -> list:
        if version != self.policy_version:
            raise RuntimeError(f"holding version {self.policy_version}, asked for {version}")
        return self._sample(prompt_ids, n, max_new_tokens or None)

    # ---- the main loop ------------------------------------------------------------------------------
    def work(self) -> None:
        self._started_work = time.monotonic()
        if self.config.mode == "sync":
            self.stop_event.wait()  # the sample RPC does the work
            return
        if not self._wait_first_version():
            return
        while not self.stop_event.is_set():
            self.watchdog.beat("sampling")  # the loop came round (each of its waits has a deadline)
            self._wait_if_stale()
            # pacing: sample only what some trainer asked this peer for (train/pacing.py)
            count = self.pusher.reserve(
                self.section.prompts_per_batch, timeout=1.0, stop_event=self.stop_event
            )
            if not count:
                continue
            ids = self.task.sample_prompt_ids(self._rng, count)
            groups = self._sample(ids, self.config.run.group_size)
            t0 = time.monotonic()
            try:
                self.pusher.submit(groups, stop_event=self.stop_event)
            except TimeoutError:
                logger.warning("%s no trainer took the batch; it stays in the outbox", self.prefix())
            self.room_wait_seconds += time.monotonic() - t0

    def _on_trainer_version(self, version: int) -> None:
        """An ack reported the trainer's version: if it is newer than ours, fetch now rather than at the
        next poll (the record may lag the ack by one publish; the follower then just reads it again)."""
        if self._newest_known is None or version > self._newest_known:
            self._newest_known = version
        if self.policy_version is None or version > self.policy_version:
            self.fetcher.nudge()

    def _sampling_due(self) -> bool:
        """``sampling`` (async): the loop must come round while this peer holds a policy and its outbox has
        room (a full outbox waits for the trainers: no stall of this peer)."""
        return (
            self.pusher is not None
            and self.policy_version is not None
            and not self.stop_event.is_set()
            and not self.pusher.outbox_full()
        )

    def _version_due(self) -> bool:
        """``version`` (async): a trainer's ack reported a version newer than the one held: it must be
        fetched and applied within the deadline (a fetch that never ends is a stall)."""
        newest, held = self._newest_known, self.policy_version
        return newest is not None and held is not None and newest > held

    def _wait_if_stale(self) -> None:
        """Async: while the trainers refuse groups of the version held as too stale, or would by the time
        they arrive (``RolloutPusher.useful_floor``: the trainers' acks report their version), every group
        sampled with it is wasted work: wait (at most ``stale_wait`` s) for a newer version first."""
        floors = [f for f in (self.pusher.stale_floor, self.pusher.useful_floor()) if f is not None]
        floor = max(floors) if floors else None
        if floor is None or self.policy_version is None or self.policy_version > floor:
            return
        self.stale_waits += 1
        self.fetcher.nudge()
        t0 = time.monotonic()
        deadline = t0 + self.section.stale_wait
        with self._new_version:
            while (
                not self.stop_event.is_set()
                and self.policy_version is not None
                and self.policy_version <= floor
                and time.monotonic() < deadline
            ):
                self._new_version.wait(min(0.1, max(0.0, deadline - time.monotonic())))
        self.weights_wait_seconds += time.monotonic() - t0

    def _wait_first_version(self) -> bool:
        t0 = time.monotonic()
        logged = False
        while self.policy_version is None:
            if self.stop_event.wait(0.2):
                return False
            if not logged and time.monotonic() - t0 > 5:
                logger.info("%s waiting for the first policy version from a trusted trainer", self.prefix())
                logged = True
            if time.monotonic() - t0 > self.section.first_version_timeout:
                logger.error(
                    "%s no policy version arrived within %.0f s; check --trusted-trainers and the run id",
                    self.prefix(),
                    self.section.first_version_timeout,
                )
                self.weights_wait_seconds += time.monotonic() - t0
                return False
        self.weights_wait_seconds += time.monotonic() - t0
        return True

    # ---- announcements and metrics ----------------------------------------------------------------------
    def role_fields(self) -> dict[str, Any]:
        served = self.fetcher.endpoint.servicer.stats.chunks_served if self.fetcher is not None else None
        return {
            "tokens_per_second": self.tokens_per_second,
            "rollouts_per_second": self.rollouts_per_second,
            "chunks_served": served,
            "waiting_for_grants": self._waiting_share(),
        }

    def _waiting_share(self) -> float | None:
        """Share of the time since the last look (at least 1 s ago) spent waiting for a trainer's grant,
        smoothed over looks: what ``swarm status`` shows and the ``samplers_waiting`` alert reads."""
        if self.pusher is None:
            return None
        now, paced = time.monotonic(), self.pusher.seconds_paced
        if self._paced_mark is None:
            self._paced_mark = (now, paced)
            return None
        since, paced_then = self._paced_mark
        if now - since >= 1.0:
            share = min(1.0, max(0.0, (paced - paced_then) / (now - since)))
            previous = self.waiting_for_grants
            self.waiting_for_grants = share if previous is None else 0.5 * previous + 0.5 * share
            self._paced_mark = (now, paced)
        return None if self.waiting_for_grants is None else round(self.waiting_for_grants, 3)

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            **self.role_fields(),
            "engine": self.section.engine,
            "groups_sampled": self.groups_sampled,
            "tokens_sampled": self.tokens_sampled,
            "seconds_waiting_for_weights": round(self.weights_wait_seconds, 3),
            "seconds_sampling": round(self.sampling_seconds, 3),
            "seconds_loading_weights": round(self.loading_seconds, 3),
        }
        if self.pusher is not None:
            push = self.pusher.stats()
            out.update(
                rollouts_sent=push["sent"],
                rollouts_acked=push["acked"],
                rollouts_duplicates=push["duplicates"],
                rollouts_rejected=push["rejected"],
                pushes_refused=push["pushes_refused"],  # whole pushes refused unread, by reason (banned, ...)
                banned_by_trainers=push["banned_by"],
                untrusted_trainers_skipped=push["untrusted_trainers_skipped"],
                seconds_waiting_for_room=push["seconds_waiting_for_room"],
                seconds_paced=push["seconds_paced"],
                room_queries=push["room_queries"],
                outbox=push["outbox"],
                rollouts_by_trainer=push["by_trainer"],
                stale_waits=self.stale_waits,
            )
        if self.sample_server is not None:
            out["sample_rpc"] = self.sample_server.stats()
        if self.fetcher is not None:
            fetch = self.fetcher.stats_dict()
            by_provider = fetch.get("bytes_by_provider") or {}
            if len(by_provider) > MAX_PROVIDERS_REPORTED:  # one metrics line stays small in a large swarm
                top = sorted(by_provider.items(), key=lambda kv: kv[1], reverse=True)
                fetch["bytes_by_provider"] = dict(top[:MAX_PROVIDERS_REPORTED])
                fetch["providers_not_reported"] = len(top) - MAX_PROVIDERS_REPORTED
            out["weights"] = fetch  # every figure (it kept the first 12 keys and lost bytes, bans, serving)
        if self.policy_version is not None and self.directory is not None:
            out["version_lag"] = self._version_lag()
        return out

    def _version_lag(self) -> int | None:
        try:
            newest = max(
                (
                    e.record.policy_version or 0
                    for e in self.directory.trainers()
                    if e.record.role == "trainer" and self.trust.is_trusted(e.record.peer_id)
                ),
                default=None,
            )
        except Exception:
            return None
        return None if newest is None else max(0, newest - (self.policy_version or 0))

    def on_shutdown(self) -> None:
        for name, closer in (
            ("pusher", lambda: self.pusher and self.pusher.shutdown()),
            ("loop", lambda: self.loop and self.loop.shutdown()),
            ("fetcher", lambda: self.fetcher and self.fetcher.shutdown()),
            ("engine", lambda: self.engine and self.engine.close()),
        ):
            try:
                closer()
            except Exception:
                logger.exception("%s error stopping the %s", self.prefix(), name)
