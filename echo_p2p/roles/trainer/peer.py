"""The trainer peer: its life cycle and training loop.

Owned here: ``TrainerPeer`` — start (the policy and ``Learner``, ``hivemind.Optimizer`` across trainers,
whose epoch is the policy version; the intake from ``assembly.build_intake``; the weight publisher and
checkpoints), the loop (a batch from the intake, a step, the version reached, publish), the heartbeat's
publisher election (``election``), the trainer's record fields and metrics, and shutdown. Exactly one
trainer publishes at a time (``election.elect_publisher``), on the schedule of ``publishing``; a trainer
behind the others catches up (``catchup``). The publisher also scores its versions on the task's held-out
prompts between two steps (``train.evaluation``: ``eval_*`` metrics lines, ``eval/`` tracker tags, its peer
record's ``eval_*``). ``trainer_derived_settings``: what the loss takes from the run, not from a setting.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter, deque
from typing import Any

from echo_p2p.metrics import peak_rss_mib
from echo_p2p.net.records import MAX_VERSIONS_PER_SECOND
from echo_p2p.roles.base import BasePeer
from echo_p2p.roles.trainer.catchup import CatchUp
from echo_p2p.roles.trainer.election import elect_publisher, version_rate
from echo_p2p.roles.trainer.known_weights import KnownWeights
from echo_p2p.roles.trainer.weights import params_finite, reload_last_good, start_on_serving_grid
from echo_p2p.train.config import DerivedSettings
from echo_p2p.train.trackers import Trackers, open_trackers, step_figures

logger = logging.getLogger(__name__)

#: Recent steps kept for the status figures and the election's pace (``version_rate``: 30 s of them).
REWARD_HISTORY = 512


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
        lossy_weights=not section.encoding.lossless,
    )


class TrainerPeer(BasePeer):
    role = "trainer"

    def __init__(self, config, identity=None):
        super().__init__(config, identity)
        self.section = config.trainer
        self.steps = 0
        self.rollouts_consumed = 0
        self.skipped_batches = 0  # batches dropped for a non-finite loss or gradient
        self.out_of_sync_batches = 0  # batches hivemind discarded, loading the others' state instead
        self.recoveries = 0  # times the weights went non-finite and the last good state was reloaded
        self.idle_seconds = 0.0
        self.update_seconds = 0.0
        # (time, version, mean reward) of the recent steps: status figures and the election's pace
        self.reward_history: deque[tuple[float, int, float]] = deque(maxlen=REWARD_HISTORY)
        self.trackers = Trackers([])  # TensorBoard / wandb (--report-to), opened in on_start
        self.last_stats: dict[str, Any] = {}
        self.is_publisher = False
        self.known_weights = KnownWeights()  # the versions it published, by stream (``_weights_known``)
        self._work_started = time.monotonic()
        self._stepper = None
        self.learner = None  # train.learner.Learner, built in on_start
        self.catch_up = None  # catchup.CatchUp, built in on_start
        self.evaluator = (
            None  # train.evaluation.Evaluator: held-out figures (the publisher), built in on_start
        )
        self.optimizer = None
        self.publisher = None  # transport.weights.publisher.WeightPublisher, started in on_start
        self.publishing = None  # publishing.PublishSchedule: which versions go out, and when
        self.loop = None
        self.guard = None  # guard.sender_guard.SenderGuard: log-prob checks and bans
        self.intake = None  # where batches come from: intake.SyncIntake or intake.AsyncIntake
        self.checkpoints = None
        self._policy_files: dict[str, bytes] | None = None  # attached to every checkpoint (export)
        self._stopping = threading.Event()
        self._in_step = False  # a batch is in hand: the step must end within the watchdog's deadline
        self.watchdog.watch("training", config.watchdog.work_deadline, due=self._training_due)

    # ---- setup ------------------------------------------------------------------------------------------
    def on_start(self) -> None:
        import torch

        from echo_p2p.collab.optimizer import CollabTrainerStep, make_collab_optimizer
        from echo_p2p.ml.engine import TransformersEngine
        from echo_p2p.ml.models import load_policy
        from echo_p2p.roles.trainer.assembly import build_intake
        from echo_p2p.roles.trainer.publishing import PublishSchedule
        from echo_p2p.tasks.registry import build_task
        from echo_p2p.train.checkpoint import CheckpointManager
        from echo_p2p.train.evaluation import Evaluator
        from echo_p2p.train.learner import Learner
        from echo_p2p.train.reference import reference_policy
        from echo_p2p.transport.p2p_loop import P2PLoop
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
        self.publishing = PublishSchedule(
            self.publisher,
            in_background=self.config.mode == "async",
            interval=section.publish_interval,
            prefix=self.prefix,
        )
        self.loop = P2PLoop.from_dht(self.dht)
        parts = build_intake(
            self.config,
            self.task,
            self.tokenizer,
            peer_id=self.peer_id,
            version=lambda: self.policy_version or 0,
            loop=self.loop,
            directory=self.directory,
            keys=self.keys,
            trust=self.trust,
            stop_event=self.stop_event,
            prefix=self.prefix,
        )
        self.intake, self.guard = parts.intake, parts.guard
        self.catch_up = CatchUp(
            self.peer_id,
            self._stepper,
            self._reached,
            self.guard.drift,
            self.directory,
            self.trust,
            self.intake.future_refused,
            self.prefix,
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
            self.idle_seconds += time.monotonic() - t0
            if batch is None:
                self.watchdog.beat("training")  # the loop came round: it looked and found no batch
                idle_since = t0 if idle_since is None else idle_since
                self._join_round_while_idle()
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

    def _join_round_while_idle(self) -> None:
        """No batch: take part in the other trainers' round of this epoch, if one is due, with what this trainer
        accumulated (nothing, weight 0), so they do not wait for it (``CollabTrainerStep.join_round_while_idle``).
        The weights moved by the same update as theirs: a new version, held and published as after a step."""
        before = self._stepper.version
        if not self._stepper.join_round_while_idle():
            return
        self.guard.drift.record(before, self._stepper.version, self.learner.measure_drift())
        if self._reached(self._stepper.version):
            self._maybe_checkpoint()

    def _training_due(self) -> bool:
        """The watchdog's ``training`` signal is due while this trainer holds a batch (in a step) or its
        intake holds one (async: buffered): a loop turn that takes longer than the deadline then is a stall.
        Idle for want of rollouts is no stall."""
        if self._in_step:
            return True
        intake = self.intake
        return intake is not None and intake.batch_due()

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
        self._forget_if_replaced()  # the step may have downloaded the others' state: before the guard judges
        drift = None
        if result.advanced:  # the weights moved: how far (the allowance of later stale groups)
            drift = self.learner.measure_drift()
            self.guard.drift.record(result.version_before, result.version, drift)
        self.update_seconds += time.monotonic() - t0
        self.guard.judge(batch, self.learner.last_group_gaps, allowances)
        self.guard.judge_samples(
            batch,
            self.learner.last_sample_scores,
            allowances,
            self.learner.last_group_repeats,
            exact=lambda index: self.learner.exact_scores(batch[index], version_before),
            draw_misses=self.learner.last_group_draw_misses,
            known=self._weights_known,
        )
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
        if result.discarded:  # out of sync: hivemind loaded the others' state instead (not a training step)
            self.intake.discarded(batch)
            self.out_of_sync_batches += 1
            logger.info(
                "%s out of sync at version %d: a batch of %d groups discarded for the others' state (now %d)",
                self.prefix(),
                result.version_before,
                len(batch),
                result.version,
            )
            if result.advanced and self._reached(result.version):
                self._maybe_checkpoint()
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
            "excluded_repeated": int(stats.get("excluded_repeated", 0)),  # its duplicate test
            "excluded_not_drawn": int(stats.get("excluded_not_drawn", 0)),  # replayed seeded draws
            "staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
            "policy_drift": None if drift is None else round(drift, 4),
            **step_figures(stats, staleness, step_s),
            "step_update_s": round(step_s, 4),
            # of which: forward/backward, and hivemind's step (at an epoch's end: waiting for the round)
            "step_compute_s": round(result.compute_s, 4),
            "step_optimizer_s": round(result.optimizer_s, 4),
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
        self._forget_if_replaced()
        self._maybe_publish()
        return True

    def _weights_known(self, group: Any) -> bool:
        """Whether the weights this trainer kept of ``group.policy_version`` are known to be those its sampler
        had (``KnownWeights.known``): the sender guard strikes for replayed draws only under such weights."""
        if self._stepper is None:
            return False
        version = group.policy_version
        return self.known_weights.known(version, group.weights_stream, self._stepper.state_shared(version))

    def _forget_if_replaced(self) -> None:
        """After a step, a catch-up or an idle round: when a state download replaced this trainer's weights with
        another lineage's since the last call, ``_weights_replaced`` (called before the guard judges and
        before a version is published, so a version published after the download counts as this lineage's)."""
        downloads = self._stepper.state_downloads if self._stepper is not None else 0
        if self.known_weights.downloaded_since(downloads):
            self._weights_replaced()

    def _weights_replaced(self) -> None:
        """A state download or a reload of the last good state replaced this trainer's weights, often under a
        version number it held already: count the versions it published as replaced (``KnownWeights``), and
        forget the weights the learner kept of each version (``PastWeights`` keeps the first copy recorded
        under a number, so the copy of the version a download landed on was this trainer's own diverged one:
        in the hour soak of 2026-12-07 a trainer replayed the samplers' draws of a version its round had just
        shared under that copy, missed by up to 0.84 of the probability mass, and banned all four)."""
        self.known_weights.weights_replaced()
        if self.learner is not None and self.learner.past is not None:
            self.learner.past.clear()

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
        self._weights_replaced()  # the versions after the reloaded one will be trained again, to other weights
        self.intake.reached(self.policy_version)
        logger.warning("%s reloaded version %d from %s", self.prefix(), self.policy_version, source)

    # ---- publishing and checkpoints ---------------------------------------------------------------------
    def _choose_publisher(self) -> bool:
        """Whether this trainer publishes (``elect_publisher`` over the directory's trainers); a directory read
        that fails says nothing about the others: the role stays as it is."""
        try:
            entries = list(self.directory.trainers())
        except Exception:
            return self.is_publisher
        return elect_publisher(
            self.peer_id,
            [e.record for e in entries],
            self.trust,
            self.policy_version or 0,
            rate=self._pace(),
            now=time.time(),
        )

    def _pace(self) -> float:
        """This trainer's versions per second over its recent steps (``version_rate``), for its record."""
        return version_rate([(t, v) for t, v, _ in list(self.reward_history)])  # a copy: steps append

    def on_heartbeat(self) -> None:
        self._update_publisher_role()
        self.guard.share(self.directory, self.config.record_ttl)
        self.intake.on_heartbeat()  # async: room for the pushes of the senders it sees

    def _update_publisher_role(self, log: bool = False) -> None:
        """Re-elect the publisher from the directory (on the heartbeat, not on every training step); not while
        stopping: the DHT may already be down, and a read that finds no other trainer then made a trainer that
        stood by take the role in its last lines (``test_training_run``'s joining-trainer test saw two
        publishers at the end)."""
        if self.stop_event.is_set():
            return
        was = self.is_publisher
        self.is_publisher = self._choose_publisher()
        if self.is_publisher != was or log:
            logger.info(
                "%s %s", self.prefix(), "publishes policy versions" if self.is_publisher else "stands by"
            )

    def _maybe_publish(self) -> None:
        """Publish the held version if this trainer is the publisher (``PublishSchedule.maybe``), and remember
        the stream it went out on (``_weights_known``)."""
        if not self.is_publisher or (self._stepper is not None and self._stepper.download_pending):
            return  # a trainer whose state is off the others' publishes nothing until the download replaced it
        from echo_p2p.weights.model_io import named_tensors

        version = self.policy_version or 0
        stream = self.publishing.publisher.stream_id
        if self.publishing.maybe(version, lambda: named_tensors(self.model)):
            self.known_weights.record(version, stream)

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
        recent = [reward for _, _, reward in list(self.reward_history)[-10:]]
        intake = self.intake
        return {
            "free_buffer_room": intake.free_room() if intake is not None else 0,
            "accepts_rollouts": intake is not None and intake.accepts_rollouts,
            "rollouts_per_second": round(self.rollouts_consumed / elapsed, 3) if self.steps else None,
            "buffered_groups": intake.buffered() if intake is not None else None,
            "max_staleness": self.section.max_staleness,
            "rollouts_consumed": self.rollouts_consumed,
            "reward_mean": round(sum(recent) / len(recent), 4) if recent else None,
            "chunks_served": self.publisher.servicer.stats.chunks_served if self.publisher else None,
            "versions_per_second": round(min(self._pace(), MAX_VERSIONS_PER_SECOND), 3),
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
            "publish_s_total": round(self.publishing.seconds, 3) if self.publishing is not None else 0.0,
            "update_s_total": round(self.update_seconds, 3),
            "publisher": self.is_publisher,
            "nonfinite_skipped": self.skipped_batches,
            "out_of_sync_discarded": self.out_of_sync_batches,
            "recoveries": self.recoveries,
            "catch_ups": self.catch_up.downloads if self.catch_up is not None else 0,
            # versions reached in the other trainers' rounds while this one had no batch
            "idle_rounds": self.optimizer.sync_stats["idle_rounds"] if self.optimizer is not None else 0,
            # gradient rounds whose average was not finite (treated as failed, never applied)
            "nonfinite_rounds": self.optimizer.sync_stats["nonfinite_rounds"]
            if self.optimizer is not None
            else 0,
            "went_on_alone": self.catch_up.went_on_alone if self.catch_up is not None else 0,
            "versions_published": self.publishing.published if self.publishing is not None else 0,
            "peak_rss_mib": peak_rss_mib(),
            "evaluations": self.evaluator.evaluations if self.evaluator is not None else 0,
            "eval_s_total": round(self.evaluator.seconds_total, 3) if self.evaluator is not None else 0.0,
        }
        if self.publisher is not None:  # what this trainer's uplink carried of the versions it published
            uploaded = self.publisher.servicer.stats.bytes_served
            out["bytes_uploaded"] = uploaded
            out["bytes_uploaded_per_version"] = round(uploaded / max(1, out["versions_published"]))
        if self.guard is not None:
            out["senders"] = self.guard.stats()
        draws = getattr(self.learner, "draws", None)
        if draws is not None:  # replays of seeded draws (train.draw_check)
            out["draws"] = {
                "replayed": draws.replayed,
                "missed": draws.missed,
                "unchecked": draws.unchecked,
                "seconds": round(draws.seconds, 3),
            }
        if self.intake is not None:  # the buffer, pacing, refusals and journal (async), refusals (sync)
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
