"""The trainer peer: ingests rollouts, trains with GRPO, averages with other trainers, publishes versions.

Owned here: wiring the training layer to the network for one trainer — the policy and ``Learner``,
``hivemind.Optimizer`` across trainers (its epoch is the policy version), the validated ingest servicer and
replay buffer (async mode) or the sample client (sync mode), the weight publisher, checkpoints, and the
trainer's metrics. Exactly one trainer publishes at a time (the running trainer with the smallest peer id,
so that inference peers see one consistent manifest per version); the others take over when it leaves.
The publisher also scores its versions on the task's held-out prompts between two steps
(``train.evaluation``: ``eval_*`` metrics lines, ``eval/`` tracker tags, its peer record's ``eval_*``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter
from typing import Any

from echo_p2p.roles.base import BasePeer
from echo_p2p.roles.trainer_catchup import CatchUp
from echo_p2p.roles.trainer_weights import (
    elect_publisher,
    params_finite,
    peak_rss_mib,
    reload_last_good,
    start_on_serving_grid,
)
from echo_p2p.train.config import DerivedSettings
from echo_p2p.train.trackers import Trackers, open_trackers, step_figures

logger = logging.getLogger(__name__)


def trainer_derived_settings(config: Any, tokenizer: Any) -> DerivedSettings:
    """What a trainer peer's loss takes from the run, not from a setting: the run's sampling temperature,
    top-k and top-p (the behaviour log-probs were computed at them), the tokenizer's pad id, the precision
    its inference peers hold (``trainer.encoding``'s receiver dtype: the policy the loss sees is theirs)
    and the log-prob gap past which a completion is left out (``trainer.reputation``)."""
    run, section = config.run, config.trainer
    return DerivedSettings(
        temperature=run.temperature,
        top_k=run.top_k,
        top_p=run.top_p,
        pad_token_id=tokenizer.pad_token_id or 0,
        policy_precision=section.encoding.receiver_dtype or "fp32",
        max_logprob_gap=section.reputation.exclude_logprob_gap,
    )


class TrainerPeer(BasePeer):
    role = "trainer"

    def __init__(self, config, identity=None):
        super().__init__(config, identity)
        self.section = config.trainer
        self.free_buffer_room = 0
        self.accepts_rollouts = False
        self.steps = 0
        self.rollouts_consumed = 0
        self.skipped_batches = 0  # batches dropped for a non-finite loss or gradient
        self.recoveries = 0  # times the weights went non-finite and the last good state was reloaded
        self.versions_published = 0
        self.idle_seconds = 0.0
        self.update_seconds = 0.0
        self.publish_seconds = 0.0
        self.reward_history: list[tuple[float, int, float]] = []  # (time, version, mean reward)
        self.buffer = None  # the replay buffer (async mode), built in on_start
        self.pacer = None  # train.pacing.Pacer: what inference peers are asked to sample (async mode)
        self.trackers = Trackers([])  # TensorBoard / wandb (--report-to), opened in on_start
        self.last_stats: dict[str, Any] = {}
        self.is_publisher = False
        self._work_started = time.monotonic()
        self._published_version: int | None = None
        self._publishing = None  # the background publish in flight (async mode), a Future
        self._published_at = -float("inf")  # monotonic time of the last publish
        self._stepper = None
        self.catch_up = None  # roles.trainer_catchup.CatchUp, built in on_start
        self.evaluator = (
            None  # train.evaluation.Evaluator: held-out figures (the publisher), built in on_start
        )
        self.optimizer = None
        self.publisher = None
        self.loop = None
        self.ingest = None
        self.guard = None  # guard.sender_guard.SenderGuard: log-prob checks and bans
        self.intake = None  # where batches come from: a SyncIntake or an AsyncIntake
        self.checkpoints = None
        self._policy_files: dict[str, bytes] | None = None  # attached to every checkpoint (export)
        self._stopping = threading.Event()
        self._in_step = False  # a batch is in hand: the step must end within the watchdog's deadline
        self.watchdog.watch("training", config.watchdog.work_deadline, due=self._training_due)

    # ---- setup ------------------------------------------------------------------------------------------
    def on_start(self) -> None:
        import torch

        from echo_p2p.collab.optimizer import CollabTrainerStep, make_collab_optimizer
        from echo_p2p.guard.rollout_checks import IngestConfig, IngestValidator
        from echo_p2p.guard.sender_guard import SenderGuard
        from echo_p2p.ml.engine import TransformersEngine
        from echo_p2p.ml.models import load_policy
        from echo_p2p.tasks.registry import build_task
        from echo_p2p.train.buffer import ReplayBuffer
        from echo_p2p.train.checkpoint import CheckpointManager
        from echo_p2p.train.evaluation import Evaluator
        from echo_p2p.train.learner import Learner
        from echo_p2p.train.reference import reference_policy
        from echo_p2p.transport.p2p_loop import P2PLoop
        from echo_p2p.transport.rollouts.config import rollout_namespace
        from echo_p2p.transport.weights.publisher import PublisherConfig, WeightPublisher

        run, section = self.config.run, self.section
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.task = build_task(run.task, run.task_options)
        spec = run.model.model_copy(update={"quantize": None})  # a trainer keeps full precision
        self.model, self.tokenizer = load_policy(spec)
        self.model.eval()  # no dropout: the importance ratio compares like with like
        grpo = section.grpo
        derived = trainer_derived_settings(self.config, self.tokenizer)
        # the KL penalty's reference: the starting policy, built from the run's model spec before any
        # checkpoint or other trainer's state is loaded (the same on a resumed or late trainer)
        reference = reference_policy(self.model, derived.policy_precision) if grpo.kl_beta > 0 else None
        self.learner = Learner(
            self.model, grpo, ref_model=reference, derived=derived, sampling_check=section.sampling_check
        )
        self.evaluator = Evaluator(
            section.evaluation,
            self.task,
            self.tokenizer,
            TransformersEngine(self.model, self.tokenizer),
            run.sampling_params(self.task.max_new_tokens),
            run.model.use_chat_template,
        )
        self.trackers = open_trackers(
            section.report,
            os.path.join(self.config.metrics_dir or "runs", "tensorboard"),
            run_name=f"trainer-{self.peer_id}",
            project=f"echo_p2p-{self.config.run_id}",
            hparams={
                "run_id": self.config.run_id,
                "mode": self.config.mode,
                **grpo.model_dump(mode="json"),
                **section.optimizer.model_dump(mode="json"),
                **dataclasses.asdict(derived),
            },
        )

        loaded = None
        if section.checkpoint_dir:
            self.checkpoints = CheckpointManager(
                section.checkpoint_dir,
                keep_last=section.keep_checkpoints,
                save_every=section.checkpoint_every,
            )
            if section.resume and self.checkpoints.latest() is not None:
                loaded = self.checkpoints.load()
                self.model.load_state_dict(loaded.model_state)  # before the optimizer copies the params
                logger.info("%s resuming from checkpoint version %d", self.prefix(), loaded.version)
        if loaded is None:
            start_on_serving_grid(self.model, self.section.encoding, self.prefix())
        self.optimizer = make_collab_optimizer(
            self.dht,
            self.config.run_id,
            self.model.parameters(),
            section.collab,
            section.optimizer,
            private_key=self.identity.private_key,
            leaving=self.stop_event,
        )
        if loaded is not None and loaded.optimizer_state is not None:
            self.optimizer.load_state_dict(loaded.optimizer_state)
        if loaded is not None:
            self.steps = int(loaded.extra.get("steps", 0))
            self.rollouts_consumed = int(loaded.extra.get("rollouts_consumed", 0))
        self._stepper = CollabTrainerStep(self.learner, self.optimizer)
        self.policy_version = self._stepper.version

        self.publisher = WeightPublisher(
            self.dht, self.identity, self.keys, PublisherConfig(encoding=section.encoding), reach=self.reach
        ).start()
        self.loop = P2PLoop.from_dht(self.dht)
        namespace = rollout_namespace(self.keys)
        vocab = len(self.tokenizer)
        self.validator = IngestValidator(
            {self.task.name: self.task},
            self.tokenizer,
            IngestConfig(
                vocab_size=vocab,
                group_size=run.group_size,
                max_prompt_tokens=section.max_prompt_tokens,
                max_completion_tokens=run.max_new_tokens,
                max_staleness=section.max_staleness if self.config.mode == "async" else 0,
                reward_tolerance=section.reward_tolerance,
                use_chat_template=run.model.use_chat_template,
                sampling=run.sampling(),
                precisions=run.sampler_precisions,
            ),
        )
        if self.config.mode == "async":
            from echo_p2p.roles.trainer_intake import AsyncIntake, async_buffer_capacity, open_journal
            from echo_p2p.rollout import RolloutGroup
            from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer

            # sized for one sender until the ingest sees more (``on_heartbeat`` resizes it)
            capacity = async_buffer_capacity(section, senders=0)
            self.buffer = ReplayBuffer(capacity, section.max_staleness, order=section.buffer_order)
            # a group within this trainer's shape limits takes at most this many bytes: bigger ones are
            # refused from their frame header, never parsed (3.1 M token ids fitted the fixed 3 MiB cap)
            shape_bound = RolloutGroup.max_wire_bytes(
                section.max_prompt_tokens, run.group_size, run.max_new_tokens or self.task.max_new_tokens
            )
            ingest_config = section.ingest_server.model_copy(
                update={"max_group_bytes": min(section.ingest_server.max_group_bytes, shape_bound)}
            )
            self.guard = SenderGuard(
                section.reputation, self.peer_id, self.buffer, self.trust, section.sampling_check
            )
            self.intake = AsyncIntake(self.buffer, section, open_journal(section), self.prefix())
            self.intake.recover(self.policy_version or 0)
            from echo_p2p.train.pacing import Pacer

            self.pacer = (
                Pacer(section.pacing, section.prompts_per_step, section.max_staleness)
                if section.pacing.enabled
                else None
            )
            self.ingest = RolloutIngestServicer(
                lambda group: self.validator.validate(group, self.policy_version or 0),
                self.buffer,
                ingest_config,
                current_version=lambda: self.policy_version or 0,
                is_banned=self.guard.is_banned,
                pacer=self.pacer,
            )
            self.loop.add_servicer(self.ingest, namespace)
            self.accepts_rollouts = True
            self.free_buffer_room = self.buffer.free_room()
        else:
            from echo_p2p.roles.trainer_intake import SyncIntake
            from echo_p2p.transport.rollouts.pull import SampleClient

            self.buffer = None
            self.guard = SenderGuard(
                section.reputation, self.peer_id, None, self.trust, section.sampling_check
            )
            client = SampleClient(
                self.loop, self.directory, section.sample_client, namespace, is_banned=self.guard.is_banned
            )
            self.intake = SyncIntake(
                client, self.validator, self.task, self.config, self.stop_event, self.prefix()
            )
        self.catch_up = CatchUp(
            self.peer_id,
            self._stepper,
            self._reached,
            self.guard.drift,
            self.directory,
            self.trust,
            lambda: self.ingest.totals.rejected["future_version"] if self.ingest is not None else 0,
            self.prefix(),
        )
        if not self.trust.configured:
            logger.warning(
                "%s the run declares no trainers (no run record, no --trusted-trainers): any peer that "
                "announces itself a trainer takes part in the publisher election",
                self.prefix(),
            )
        elif not self.trust.is_trusted(self.peer_id):
            logger.warning(
                "%s is not one of the run's trainers (%s): it trains but never publishes",
                self.prefix(),
                self.trust.describe(),
            )
        self._update_publisher_role(log=True)
        self._maybe_publish()
        self.announce()

    # ---- the training loop --------------------------------------------------------------------------
    def work(self) -> None:
        self._work_started = time.monotonic()
        idle_since: float | None = None
        self._maybe_evaluate()  # the starting policy, before a sync trainer's first collect blocks on samplers
        while not self.stop_event.is_set():
            if self.section.max_steps is not None and self.steps >= self.section.max_steps:
                logger.info("%s reached max_steps=%d; stopping", self.prefix(), self.section.max_steps)
                break
            t0 = time.monotonic()
            batch = self.intake.collect(self.policy_version or 0)
            if self.buffer is not None:
                self.free_buffer_room = self.buffer.free_room()
            self.idle_seconds += time.monotonic() - t0
            if batch is None:
                self.watchdog.beat("training")  # the loop came round: it looked and found no batch
                idle_since = t0 if idle_since is None else idle_since
                self.catch_up.maybe(idle_since)
                self._maybe_publish()  # a version skipped while a publish was in flight goes out now
                self._maybe_evaluate()
                continue
            idle_since = None
            self._in_step = True
            try:
                self._train(batch)
            finally:
                self._in_step = False
            self.watchdog.beat("training")
            self._maybe_evaluate()
        self.stop_event.set()

    def _training_due(self) -> bool:
        """The watchdog's ``training`` signal is due while this trainer holds a batch (in a step) or its
        buffer holds one (async): a loop turn that takes longer than the deadline then is a stall.
        Idle for want of rollouts is no stall."""
        if self._in_step:
            return True
        buffer = self.buffer
        return buffer is not None and buffer.peek_size() >= self.section.prompts_per_step

    def _maybe_evaluate(self) -> None:
        """The publisher scores the version it holds on the held-out prompts when one is due (between two
        steps, within ``trainer.evaluation.max_share`` of the time): a metrics line and ``eval/`` tags."""
        if not self.is_publisher or self.evaluator is None or self.stop_event.is_set():
            return
        figures = self.evaluator.maybe_record(
            self.policy_version or 0, self.metrics, self.prefix(), steps=self.steps
        )
        if figures is not None:
            self.trackers.log(figures, self.steps)

    def _train(self, batch: list) -> None:
        t0 = time.monotonic()
        version_before = self.policy_version or 0
        allowances = self.guard.allowances(batch, version_before)
        result = self._stepper(batch, gap_allowance=allowances)
        drift = None
        if result.advanced:  # the weights moved: how far (the allowance of later stale groups)
            drift = self.learner.measure_drift()
            self.guard.drift.record(result.version_before, result.version, drift)
        self.update_seconds += time.monotonic() - t0
        self.guard.judge(batch, self.learner.last_group_gaps, allowances)
        self.guard.judge_samples(batch, self.learner.last_sample_scores, allowances)
        if result.skipped:
            self.intake.discarded(batch)
            self.skipped_batches += 1
            logger.warning(
                "%s dropped a batch of %d groups whose loss or gradient is not finite (%d so far)",
                self.prefix(),
                len(batch),
                self.skipped_batches,
            )
            return
        self.intake.used(batch)
        self.steps += 1
        self.rollouts_consumed += len(batch)
        rewards = [r for g in batch for r in g.rewards]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        staleness = Counter(version_before - g.policy_version for g in batch)
        self.reward_history.append((time.time(), result.version, mean))
        stats, step_s = result.stats, time.monotonic() - t0
        self.last_stats = {
            "reward_mean": round(mean, 4),
            "reward_std": round(std, 4),
            "loss": round(float(stats.get("loss", 0.0)), 5),
            "clip_frac": round(float(stats.get("clip_frac", 0.0)), 4),
            "ratio_mean": round(float(stats.get("ratio_mean", 1.0)), 4),
            # how far the samplers were from this policy, and what the decoupled objective weighed them
            "outside_clip_frac": round(float(stats.get("behaviour_outside_clip_frac", 0.0)), 4),
            "behaviour_weight_mean": round(float(stats.get("behaviour_weight_mean", 1.0)), 4),
            "logprob_gap_max": round(float(stats.get("logprob_gap_max", 0.0)), 4),
            "excluded_not_sampled": int(stats.get("excluded_not_sampled", 0)),  # guard.sampling_check
            "staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
            "policy_drift": None if drift is None else round(drift, 4),
            **step_figures(stats, staleness, step_s),
            "step_update_s": round(step_s, 4),
        }
        if result.advanced:
            if not self._reached(result.version):
                return
            self._maybe_checkpoint()
        self.metrics.write(self.policy_version, step=self.steps, **self.last_stats, **self._counters())
        extra = {"rollouts_consumed": self.rollouts_consumed, "version": self.policy_version}
        self.trackers.log({**self.last_stats, **extra}, self.steps)

    def _reached(self, version: int) -> bool:
        """The weights moved to ``version`` (an update or a download): hold it, drop what is too stale, publish;
        False when they are not finite (``_recover_nonfinite`` reloads the last good state instead)."""
        if not params_finite(self.model):
            self._recover_nonfinite()
            return False
        self.policy_version = version
        self.intake.reached(version)
        self._maybe_publish()
        return True

    def _recover_nonfinite(self) -> None:
        """The weights went NaN/inf after an update: reload the last good state (``reload_last_good``), or
        stop with an error rather than publish or train on broken weights."""
        self.recoveries += 1
        logger.error(
            "%s weights are not finite after an update; reloading the last good state", self.prefix()
        )
        source = reload_last_good(self.model, self.optimizer, self.checkpoints)
        if source is None:
            logger.error(
                "%s no good state to reload (no checkpoint, no other trainer); stopping", self.prefix()
            )
            self.exit_code = 1
            self.stop_event.set()
            return
        self.policy_version = self._stepper.version
        self.guard.drift.reset()
        self.intake.reached(self.policy_version)
        logger.warning("%s reloaded version %d from %s", self.prefix(), self.policy_version, source)

    # ---- publishing and checkpoints ---------------------------------------------------------------------
    def _choose_publisher(self) -> bool:
        """Whether this trainer publishes (``elect_publisher`` over the directory's trainers)."""
        try:
            entries = list(self.directory.trainers())
        except Exception:
            entries = []
        return elect_publisher(
            self.peer_id, [e.record for e in entries], self.trust, self.policy_version or 0
        )

    def on_heartbeat(self) -> None:
        self._update_publisher_role()
        self.guard.share(self.directory, self.config.record_ttl)
        if self.ingest is not None:  # async: room for the pushes of the senders it sees
            from echo_p2p.roles.trainer_intake import async_buffer_capacity

            self.buffer.resize(async_buffer_capacity(self.section, self.ingest.active_senders()))

    def _update_publisher_role(self, log: bool = False) -> None:
        """Re-elect the publisher from the directory (on the heartbeat, not on every training step)."""
        was = self.is_publisher
        self.is_publisher = self._choose_publisher()
        if self.is_publisher != was or log:
            logger.info(
                "%s %s", self.prefix(), "publishes policy versions" if self.is_publisher else "stands by"
            )

    def _maybe_publish(self) -> None:
        """Publish the held version if this trainer is the publisher and has not published it yet.

        Sync mode publishes in line: the next batch is asked for at this version. Async mode snapshots the
        weights and encodes, signs and announces them in the publisher's worker thread while training
        goes on; while one publish is in flight newer versions wait, and only the newest goes out next.
        """
        from echo_p2p.weights.model_io import named_tensors

        version = self.policy_version or 0
        if not self.is_publisher or self._published_version == version:
            return
        t0 = time.monotonic()
        if self.config.mode == "sync":
            self.publisher.publish(named_tensors(self.model), version)
        else:
            if t0 - self._published_at < self.section.publish_interval:
                return
            if self._publishing is not None:
                if not self._publishing.done():
                    return
                self._publish_done()
            self._publishing = self.publisher.publish_in_background(named_tensors(self.model), version)
        self.publish_seconds += time.monotonic() - t0
        self._published_version = version
        self._published_at = t0
        self.versions_published += 1

    def _publish_done(self) -> None:
        future, self._publishing = self._publishing, None
        exc = future.exception() if future is not None else None
        if exc is not None:
            logger.error("%s publishing a version failed: %r", self.prefix(), exc)

    def _maybe_checkpoint(self, force: bool = False) -> None:
        if self.checkpoints is None:
            return
        version = self.policy_version or 0
        if not force and not self.checkpoints.due(version):
            return
        latest = self.checkpoints.latest()
        if latest is not None and latest.version > version:
            return  # never write a version lower than one on disk
        self._stepper.settle()
        from echo_p2p.export.policy_files import policy_files, policy_meta

        if self._policy_files is None:  # the model's config and tokenizer: the checkpoint describes itself
            self._policy_files = policy_files(self.model, self.tokenizer)
        self.checkpoints.save(
            version,
            self.model.state_dict(),
            self.optimizer.state_dict(),
            {
                "steps": self.steps,
                "rollouts_consumed": self.rollouts_consumed,
                **policy_meta(self.config.run, self.section.encoding.receiver_dtype),
            },
            files=self._policy_files,
        )

    # ---- announcements and metrics ----------------------------------------------------------------------
    def role_fields(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self._work_started)
        recent = [reward for _, _, reward in self.reward_history[-10:]]
        return {
            "free_buffer_room": self.free_buffer_room,
            "accepts_rollouts": self.accepts_rollouts,
            "rollouts_per_second": round(self.rollouts_consumed / elapsed, 3) if self.steps else None,
            "buffered_groups": len(self.buffer) if self.buffer is not None else None,
            "max_staleness": self.section.max_staleness,
            "rollouts_consumed": self.rollouts_consumed,
            "reward_mean": round(sum(recent) / len(recent), 4) if recent else None,
            "chunks_served": self.publisher.servicer.stats.chunks_served if self.publisher else None,
            **self._eval_fields(),
        }

    def _eval_fields(self) -> dict[str, Any]:
        """The newest held-out figures for the peer record (monitors draw them), or nothing."""
        last = self.evaluator.last if self.evaluator is not None else None
        if last is None:
            return {}
        return {k: last[k] for k in ("eval_version", "eval_accuracy", "eval_reward")}

    def _counters(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self._work_started)
        out: dict[str, Any] = {
            "steps": self.steps,
            "rollouts_consumed": self.rollouts_consumed,
            "idle_fraction": round(self.idle_seconds / elapsed, 4),
            "idle_s_total": round(self.idle_seconds, 3),
            "publish_s_total": round(self.publish_seconds, 3),
            "update_s_total": round(self.update_seconds, 3),
            "publisher": self.is_publisher,
            "nonfinite_skipped": self.skipped_batches,
            "recoveries": self.recoveries,
            "catch_ups": self.catch_up.downloads if self.catch_up is not None else 0,
            "went_on_alone": self.catch_up.went_on_alone if self.catch_up is not None else 0,
            "versions_published": self.versions_published,
            "peak_rss_mib": peak_rss_mib(),
            "evaluations": self.evaluator.evaluations if self.evaluator is not None else 0,
            "eval_s_total": round(self.evaluator.seconds_total, 3) if self.evaluator is not None else 0.0,
        }
        if self.publisher is not None:  # what this trainer's uplink carried of the versions it published
            uploaded = self.publisher.servicer.stats.bytes_served
            out["bytes_uploaded"] = uploaded
            out["bytes_uploaded_per_version"] = round(uploaded / max(1, self.versions_published))
        if self.buffer is not None:
            stats = self.buffer.stats().as_dict()
            out["buffer"] = {
                k: stats[k] for k in ("size", "free_room", "dropped_stale", "evicted", "duplicates")
            }
            out["dropped_stale"] = stats["dropped_stale"]
        if self.pacer is not None:
            out["pacing"] = self.pacer.stats()
        if self.guard is not None:
            out["senders"] = self.guard.stats()
        if self.ingest is not None:
            ingest = self.ingest.stats()
            out["rejected"] = dict(ingest.get("rejected", {}))
            # the reward of what samplers send, useless groups included (reward_mean is that of what is
            # trained on, biased low once the policy is mostly right: its all-right groups are dropped)
            out["received_reward_mean"] = ingest.get("received_reward_mean")
        elif self.intake is not None and self.intake.rejected:
            out["rejected"] = dict(self.intake.rejected)
        if self.intake is not None:
            out.update(self.intake.figures())
        return out

    def figures(self) -> dict[str, Any]:
        return {**self.role_fields(), **self._counters(), **{k: v for k, v in self.last_stats.items()}}

    def on_shutdown(self) -> None:
        from echo_p2p.collab.optimizer import shutdown_optimizer

        if self._stepper is not None and self.checkpoints is not None:
            try:
                self._maybe_checkpoint(force=True)
            except Exception:
                logger.exception("%s final checkpoint failed", self.prefix())
        for name, closer in (
            ("ingest", lambda: self.ingest and self.ingest.shutdown()),
            ("intake", lambda: self.intake and self.intake.close()),
            ("loop", lambda: self.loop and self.loop.shutdown()),
            ("publisher", lambda: self.publisher and self.publisher.shutdown()),
            ("optimizer", lambda: self.optimizer is not None and shutdown_optimizer(self.optimizer)),
            ("trackers", self.trackers.close),
        ):
            try:
                closer()
            except Exception:
                logger.exception("%s error stopping the %s", self.prefix(), name)
