"""Gradient aggregation across the training swarm with ``hivemind.Optimizer``; its epoch is the policy version.

Owned here: ``CollabOptimizerConfig`` (every knob of the collaborative optimizer, with settings proven on
loopback), ``trainer_swarm_run_id`` (the optimizer's ``run_id``, derived from the echo run id: one per run,
shared by every trainer of it), ``make_collab_optimizer`` (a ``hivemind.Optimizer`` wrapping AdamW over the
policy's parameters; precisely ``collab.sync.SyncedOptimizer``, which keeps the trainers' states identical),
``CollabTrainerStep`` (``Learner.compute_gradients`` then ``optimizer.step``, reporting
whether a new policy version was reached) and ``shutdown_optimizer`` (bounded shutdown).
Called by the trainer peer, tests and benchmarks. Must not compute losses (``echo_p2p.train`` does) nor
publish weights (the weights transport does): it turns local gradients into swarm-wide optimizer epochs.

How the trainers meet
---------------------
Every trainer of run ``R`` builds its optimizer with ``run_id = trainer_swarm_run_id(R)``. Each call of
``CollabTrainerStep`` adds one local batch (``len(groups)`` rollout groups, by default) to the swarm's
progress; once the trainers together reach ``target_batch_size`` groups, they average their accumulated
gradients in one all-reduce round, every one of them applies the same AdamW update, and ``local_epoch``
(the policy version) goes up by one on all of them. A lone trainer does the same with its own gradients.
A trainer that joins late (or fell behind) sees a higher global epoch and downloads the parameters, the
optimizer state and the epoch from a peer (``load_state_from_peers``): it catches up, and versions never
diverge between trainers. hivemind's ``epoch`` is therefore echo_p2p's policy ``version``.

hivemind alone keeps only the epochs together: after an all-reduce that failed for one trainer, a solo
first epoch, or a round that paired a trainer with the other's next epoch, two trainers hold different
parameters and Adam statistics under the same version (seen as a 7.7e-4 difference in the collab test).
``collab.sync.SyncedOptimizer`` tags every gradient round with each member's (epoch, sync token); a
member that is not on the round's reference, or whose round failed while other trainers are known,
downloads the whole state at its next step. Trainers therefore hold the same state after every epoch they
averaged together (up to the all-reduce's float rounding) and re-synchronise by the next step or the next
shared round after a failure; ``CollabTrainerStep.in_sync`` says whether the last epoch was agreed.
hivemind's state averaging is off by default (``average_state_every=0``): it averaged parameters only and
undid none of this. The first shared round of two fresh trainers always costs one state download.

Measured (``tests/integration/collab_trainer.py``; 2 shared CPU cores under load from other jobs, tiny policy,
local steps of 4 groups x G=8 paced to ~0.24 s, ``target_batch_size=16`` groups, 10 epochs, medians):

=====================================  ===========  ============================  ===============
setting                                epoch (s)    blocked in ``step`` at the    local steps per
                                                    epoch end (s)                 epoch, each
=====================================  ===========  ============================  ===============
lone trainer                           0.95         0.008                         4.0
two trainers, ``matchmaking_time=1``   1.34         0.61                          3.0
two trainers, ``matchmaking_time=2``   2.33         1.60                          2.9
two trainers, ``matchmaking_time=.5``  0.86         0.13 (one round timed out:    2.9
                                                    a 10 s stall in 10 epochs)
=====================================  ===========  ============================  ===============

A lone trainer skips the all-reduce, so its per-epoch overhead is ~0.01 s. With two or more, an epoch
costs about ``matchmaking_time + 0.3 s`` of wall time whatever the compute below that (hivemind
pre-schedules the round, and the trainers keep accumulating while it assembles: here 24 groups per epoch
for a target of 16). Size ``target_batch_size`` so that an epoch's compute is several times
``matchmaking_time`` (and several progress refreshes): with epochs of ~0.1 s of compute the trainers
race through epochs solo, averaging rounds time out (``averaging_timeout`` stalls) and one of them keeps
reloading state; with the paced settings above they average together from the first epoch.

Traps
-----
- ``start_dht`` signs records with the peer's identity key, and the DHT keeps one RSA signature validator:
  hivemind's progress tracker must sign with that same key, so pass ``private_key=identity.private_key``;
  otherwise every progress record is rejected and the trainers never see each other.
- The optimizer keeps its own (offloaded) copy of the parameters. Load checkpointed weights into the model
  *before* ``make_collab_optimizer``, then ``optimizer.load_state_dict(state)`` (it carries the epoch;
  the first epoch after a resume may take one progress refresh longer).
- Never wait on ``tracker.global_progress.num_peers`` as a start barrier: a peer publishes progress only
  after its first step. Peers may train solo for the first epoch or two and then synchronise by
  loading state from each other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo_p2p import PROTOCOL_VERSION
from echo_p2p.net.keys import validate_run_id

if TYPE_CHECKING:  # pragma: no cover
    import hivemind
    import torch

    from echo_p2p.train.config import OptimizerConfig
    from echo_p2p.train.learner import Learner
    from echo_p2p.train.scored import ScoredGroup

logger = logging.getLogger(__name__)


def trainer_swarm_run_id(run_id: str) -> str:
    """The ``hivemind.Optimizer`` run id of echo run ``run_id``: every trainer of the run uses this one, and
    it carries the protocol version, so two runs or two protocol versions never average with each other."""
    return f"echo-v{PROTOCOL_VERSION}-{validate_run_id(run_id)}-trainers"


class CollabOptimizerConfig(BaseModel):
    """Settings of the trainers' ``hivemind.Optimizer`` (the AdamW inside it is ``train.config.OptimizerConfig``).
    Every trainer of a run must use the same values, except ``batch_size_per_step``, ``client_mode`` and
    ``verbose``, which are per peer."""

    model_config = ConfigDict(extra="forbid")

    target_batch_size: int = Field(
        default=16,
        ge=1,
        description="Rollout groups (the unit of ``CollabTrainerStep``) that the trainers together "
        "accumulate per epoch, i.e. per policy version. One epoch costs a gradient round when several "
        "trainers are present (matchmaking and an all-reduce): make it large enough that compute dominates.",
    )
    batch_size_per_step: int | None = Field(
        default=None,
        ge=1,
        description="Groups one local step adds to the swarm's progress by default; None: the caller "
        "passes ``batch_size`` to every ``step`` (``CollabTrainerStep`` always does).",
    )
    matchmaking_time: float = Field(
        default=1.0,
        gt=0,
        description="Longest wait of a gradient round for trainers to join its group: a group of every "
        "trainer the progress records show begins as soon as they all joined, a smaller one at the end of "
        "this time (``collab.averagers.group_size``). 1.0 s works on loopback and LANs; 3-5 s over the internet.",
    )
    averaging_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds after which an averaging round is cancelled (the trainer then proceeds with its "
        "local gradients). About twice the real all-reduce time.",
    )
    next_chunk_timeout: float | None = Field(
        default=2.5,
        gt=0,
        description="Seconds a gradient all-reduce waits for a member's next part (hivemind's "
        "``next_chunk_timeout``; a member later than that is left out of the part and the round comes back "
        "partial, twice that for a part's result; also the wait for each message of a state download). "
        "None: ``matchmaking_time``, hivemind's default: 1 s left one round in seven partial on two loaded "
        "cores, each followed by a state download (docs/reliability.md).",
    )
    request_timeout: float = Field(
        default=0.5,
        gt=0,
        description="Seconds a matchmaking request waits for the group leader; must be below "
        "``matchmaking_time`` (hivemind deadlocks otherwise). Used by both gradient and state averagers.",
    )
    load_state_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a late or lagging trainer waits for one download of the swarm's state.",
    )
    average_state_every: int = Field(
        default=0,
        ge=0,
        description="0 (default): no hivemind state averaging; trainers are kept identical by the sync check "
        "of every gradient round and a state download when it fails (``collab.sync``). N >= 1: also average "
        "parameters (not the optimizer statistics) every N epochs; that mixes the states of out-of-sync "
        "trainers behind the sync check's back, so trainers are then only approximately equal.",
    )
    delay_state_averaging: bool = Field(
        default=True,
        description="With ``average_state_every`` >= 1: average the state in a background thread and apply "
        "it at the next step (True, cheap), or synchronously inside the epoch's step (False).",
    )
    reuse_grad_buffers: bool = Field(
        default=False,
        description="Accumulate in the model's ``.grad`` instead of separate buffers (saves memory). Then "
        "hivemind owns zeroing, ``CollabTrainerStep`` passes ``zero_grad=False``, and the Learner's "
        "gradient-norm clip applies to the running sum instead of each step's gradient.",
    )
    compression: Literal["none", "float16"] = Field(
        default="none",
        description="Wire encoding of averaged gradients and state; state downloads by late joiners are "
        "always exact.",
    )
    progress_refresh_min: float = Field(
        default=0.5,
        gt=0,
        description="Shortest interval (s) between two reads of the swarm's progress from the DHT.",
    )
    progress_refresh_max: float = Field(
        default=3.0,
        gt=0,
        description="Longest interval (s) between two reads of the swarm's progress; lower notices new "
        "trainers sooner at the cost of DHT traffic.",
    )
    progress_expiration: float = Field(
        default=10.0,
        gt=0,
        description="Lifetime (s) of a trainer's progress record (re-stored at every step and at least every "
        "half of this): a trainer killed or cut off stops being counted, and its averaging rounds waited for, "
        "after this long (at 30 s a killed trainer stalled the other one's versions for 30 s: "
        "tests/integration/test_churn.py, docs/reliability.md).",
    )
    lone_progress_interval: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="While a trainer knows of no other trainer, fewest seconds between two stores of its "
        "progress record (otherwise: every step, as hivemind does; 0: every step always). A newcomer reads "
        "an epoch at most this old, then downloads the actual state (docs/protocol.md).",
    )
    client_mode: bool | None = Field(
        default=None,
        description="Do not accept incoming averaging connections and do not serve state (behind NAT); "
        "None: as the DHT. Honoured by ``SyncedOptimizer`` (plain hivemind 1.1.12 ignores it).",
    )
    shutdown_timeout: float = Field(
        default=5.0, gt=0, description="Seconds each averager may take to leave the swarm on shutdown."
    )
    verbose: bool = Field(default=False, description="Log hivemind's optimizer events at INFO level.")

    @model_validator(mode="after")
    def _check(self) -> CollabOptimizerConfig:
        if self.request_timeout >= self.matchmaking_time:
            raise ValueError(
                f"request_timeout ({self.request_timeout}) must be below matchmaking_time "
                f"({self.matchmaking_time}), otherwise hivemind's matchmaking can deadlock"
            )
        if self.progress_refresh_min > self.progress_refresh_max:
            raise ValueError("progress_refresh_min must not exceed progress_refresh_max")
        return self


def link_timeouts(
    num_params: int, link_mbit: float, trainers: int = 2, compression: str = "float16"
) -> dict[str, float]:
    """``CollabOptimizerConfig`` deadlines under which a model of ``num_params`` parameters averages and
    downloads its state over a ``link_mbit`` Mbit/s link (each way) among ``trainers`` trainers.

    - a gradient round moves ``(trainers-1)/trainers`` of the gradients each way (hivemind's butterfly
      all-reduce), fp16 or fp32: ``averaging_timeout`` is twice that transfer plus the matchmaking;
    - a state download moves the fp32 parameters and AdamW's two moments (12 bytes per parameter):
      ``load_state_timeout`` is 1.5 times that;
    - matchmaking: 5 s once a round takes longer than a second (1 s, the loopback setting, below).
    The values are rounded up to 10 s; ``docs/scaling.md`` has the table for SmolLM2 and a 7B model."""
    rate = link_mbit * 1e6 / 8  # bytes per second
    grad_bytes = num_params * (2 if compression == "float16" else 4) * (trainers - 1) / trainers
    state_bytes = num_params * 12
    transfer = grad_bytes / rate
    matchmaking = 1.0 if transfer < 1.0 else 5.0

    def up(seconds: float) -> float:
        return float(max(10, -(-int(seconds) // 10) * 10))

    return {
        "matchmaking_time": matchmaking,
        "request_timeout": 0.5 if matchmaking == 1.0 else 3.0,
        "averaging_timeout": up(2 * transfer + matchmaking),
        "load_state_timeout": up(1.5 * state_bytes / rate),
    }


def make_collab_optimizer(
    dht: hivemind.DHT,
    run_id: str,
    params: Iterable[torch.Tensor],
    config: CollabOptimizerConfig,
    optimizer: OptimizerConfig,
    *,
    private_key: Any | None = None,
    leaving: threading.Event | None = None,
) -> hivemind.Optimizer:
    """A ``hivemind.Optimizer`` (``optimizer.adamw`` inside) over ``params`` for the trainers of echo run
    ``run_id``.

    :param dht: a running DHT joined to the swarm (e.g. from ``echo_p2p.net.node.start_dht``)
    :param run_id: the echo run id; the optimizer's own run id is ``trainer_swarm_run_id(run_id)``
    :param params: the trainable parameters of the policy (load any checkpoint into them first)
    :param private_key: the key the DHT signs records with (``identity.private_key`` when the DHT came
        from ``start_dht``); None: hivemind's process-wide key, right for a plain ``hivemind.DHT``
    :param leaving: an event the caller sets when it leaves the run (e.g. its stop event): a gradient round
        still waited for is then abandoned rather than waited out (``averaging_timeout``)
    Gradients are averaged once per epoch (``use_local_updates=False``): every trainer of an epoch applies the
    same update. ``optimizer.local_epoch`` is the policy version.
    """
    from hivemind.compression import Float16Compression, NoCompression

    from echo_p2p.collab.sync import NEVER, SyncedOptimizer

    compression = Float16Compression() if config.compression == "float16" else NoCompression()
    tracker_opts: dict[str, Any] = dict(
        min_refresh_period=config.progress_refresh_min,
        max_refresh_period=config.progress_refresh_max,
        default_refresh_period=min(max(1.0, config.progress_refresh_min), config.progress_refresh_max),
        metadata_expiration=config.progress_expiration,
    )
    if private_key is not None:
        tracker_opts["private_key"] = private_key
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters to optimise")
    return SyncedOptimizer(
        dht=dht,
        leaving=leaving,
        run_id=trainer_swarm_run_id(run_id),
        params=params,
        optimizer=optimizer.adamw,
        target_batch_size=config.target_batch_size,
        batch_size_per_step=config.batch_size_per_step,
        use_local_updates=False,
        matchmaking_time=config.matchmaking_time,
        averaging_timeout=config.averaging_timeout,
        next_chunk_timeout=config.next_chunk_timeout,
        load_state_timeout=config.load_state_timeout,
        average_state_every=config.average_state_every or NEVER,
        delay_state_averaging=config.delay_state_averaging,
        reuse_grad_buffers=config.reuse_grad_buffers,
        client_mode=config.client_mode,
        grad_compression=compression,
        state_averaging_compression=compression,
        averager_opts=dict(request_timeout=config.request_timeout),
        grad_averager_opts=dict(request_timeout=config.request_timeout),
        tracker_opts=tracker_opts,
        lone_progress_interval=config.lone_progress_interval,
        shutdown_timeout=config.shutdown_timeout,
        verbose=config.verbose,
    )


def shutdown_optimizer(optimizer: hivemind.Optimizer, timeout: float = 15.0) -> bool:
    """Leave the swarm (progress record, averagers' child processes) within ``timeout`` seconds.
    Returns False when it did not finish in time (the caller then shuts the DHT down regardless)."""
    from echo_p2p.net.node import call_with_deadline

    if not call_with_deadline(optimizer.shutdown, timeout, "collab-optimizer-shutdown"):
        logger.warning("hivemind.Optimizer did not shut down within %.0f s", timeout)
        return False
    return True


@dataclass
class CollabStepResult:
    """What one ``CollabTrainerStep`` call did."""

    stats: dict[str, float]  # the learner's stats of this local batch (loss, reward_mean, grad_norm, ...)
    version_before: int  # local_epoch before the step
    version: int  # local_epoch after it: the policy version the model now holds
    batch_size: int  # progress this step reported (groups or sequences, see ``CollabTrainerStep``)
    compute_s: float  # seconds in forward/backward
    optimizer_s: float  # seconds in ``optimizer.step`` (accumulation; averaging and update at an epoch end)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def advanced(self) -> bool:
        """True when this step reached a new policy version (an epoch ended, or state was loaded)."""
        return self.version > self.version_before

    @property
    def skipped(self) -> bool:
        """True when the batch was not stepped on (a non-finite loss or gradient: see ``Learner``)."""
        return "skipped" in self.extra

    @property
    def discarded(self) -> bool:
        """True when hivemind threw the batch away: it found this trainer out of sync at the step and loaded
        (or tried to load) the others' state instead of accumulating it (``version`` says which it holds)."""
        return "discarded" in self.extra

    @property
    def caught_up(self) -> bool:
        """True when the version jumped by more than one: state was downloaded from other trainers."""
        return self.version > self.version_before + 1


class CollabTrainerStep:
    """One local training step of a trainer in the swarm: GRPO gradients, then ``optimizer.step``.

    ``batch_unit`` says what counts towards ``target_batch_size``: ``"groups"`` (default: rollout groups,
    the unit the replay buffer hands out) or ``"sequences"`` (completions). The gradient of each call is the
    learner's (token-)mean over its batch; hivemind averages the calls of an epoch weighted by batch size.
    A step whose gradients were computed on an out-of-date policy is discarded by hivemind (it loads the
    swarm's state instead); ``result.caught_up`` tells the caller.
    """

    def __init__(
        self,
        learner: Learner,
        optimizer: hivemind.Optimizer,
        batch_unit: Literal["groups", "sequences"] = "groups",
    ) -> None:
        if batch_unit not in ("groups", "sequences"):
            raise ValueError(f"batch_unit must be 'groups' or 'sequences', got {batch_unit!r}")
        self.learner = learner
        self.optimizer = optimizer
        self.batch_unit = batch_unit
        averager = getattr(optimizer, "grad_averager", None)
        self._zero_grad = not (averager is not None and averager.reuse_grad_buffers)

    @property
    def version(self) -> int:
        """The policy version this trainer holds (the optimizer's local epoch)."""
        return int(self.optimizer.local_epoch)

    @property
    def in_sync(self) -> bool:
        """True when this trainer's last epoch was agreed with the other trainers of its round (or its state
        was just downloaded from one, or it is alone): see ``echo_p2p.collab.sync``."""
        return bool(getattr(self.optimizer, "in_sync", True))

    def state_shared(self, version: int) -> bool:
        """Whether every trainer of the gradient round that left ``version`` held this trainer's weights of it
        (``echo_p2p.collab.sync.SyncedOptimizer.state_shared``; False for a plain torch optimizer)."""
        shared = getattr(self.optimizer, "state_shared", None)
        return shared is not None and shared(version)

    @property
    def state_downloads(self) -> int:
        """States downloaded from other trainers so far (``SyncedOptimizer``'s resyncs and catch-ups; 0 for a
        plain torch optimizer): each replaced this trainer's weights with another lineage's."""
        return self._sync_count("resyncs")

    @property
    def download_pending(self) -> bool:
        """Whether this trainer's last epoch found its state off the others' and a download of theirs is due
        (``SyncedOptimizer``'s "out of sync ... will download it"; False for a plain torch optimizer): the
        version it holds is a lineage the download will replace."""
        return bool(getattr(self.optimizer, "download_pending", False))

    def settle(self) -> None:
        """Wait for background state averaging (``delay_state_averaging``) and apply its result, so the
        model holds the swarm's final parameters of this version: call before a checkpoint or a result."""
        self.optimizer.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)

    def join_round_while_idle(self) -> bool:
        """For a trainer with no batch: take part in the other trainers' gradient round of this epoch and apply
        the same update (``SyncedOptimizer.join_round_while_idle``), so they do not wait for it. True when the
        version moved."""
        join = getattr(self.optimizer, "join_round_while_idle", None)
        return bool(join()) if join is not None else False

    def catch_up(self, force: bool = False) -> bool:
        """For a trainer with nothing to train on: when other trainers are ahead (or the last round asked
        for a download), load their state now (``SyncedOptimizer.catch_up``; ``force``: whatever the progress
        records say). True when a state was loaded; ``version`` then says where this trainer stands."""
        catch_up = getattr(self.optimizer, "catch_up", None)
        return bool(catch_up(force=force)) if catch_up is not None else False

    def advance_to(self, version: int) -> bool:
        """Hold ``version`` from now on with the weights this trainer has (``SyncedOptimizer.advance_to``):
        when the version the swarm was at can no longer be downloaded from anyone."""
        advance = getattr(self.optimizer, "advance_to", None)
        return bool(advance(version)) if advance is not None else False

    def batch_size_of(self, groups: Sequence[ScoredGroup]) -> int:
        if self.batch_unit == "groups":
            return len(groups)
        return sum(len(g.group.completions) for g in groups)

    def __call__(
        self, groups: Sequence[ScoredGroup], gap_allowance: Sequence[float | None] | None = None
    ) -> CollabStepResult:
        """One step on ``groups`` (``gap_allowance``: per group, see ``Learner.compute_gradients``)."""
        if not groups:
            raise ValueError("a collaborative step needs at least one group")
        before = self.version
        t0 = time.perf_counter()
        stats = self.learner.compute_gradients(
            groups, zero_grad=self._zero_grad, gap_allowance=gap_allowance, current_version=before
        )
        t1 = time.perf_counter()
        batch_size = self.batch_size_of(groups)
        if stats.get("nonfinite"):
            # a batch whose loss or gradient is NaN/inf reports no progress and is never averaged
            return CollabStepResult(stats, before, before, 0, t1 - t0, 0.0, {"skipped": "nonfinite"})
        loads = self._sync_count("resyncs", "resync_failures")  # state downloads tried, loaded or not
        self.optimizer.step(batch_size=batch_size)
        t2 = time.perf_counter()
        # hivemind's step, finding this trainer out of sync, loads the others' state and returns without
        # accumulating the batch (its gradients are of a state being replaced): the only load inside a step
        discarded = self._sync_count("resyncs", "resync_failures") != loads
        extra = {"discarded": "out_of_sync"} if discarded else {}
        return CollabStepResult(
            stats=stats,
            version_before=before,
            version=self.version,
            batch_size=0 if extra else batch_size,
            compute_s=t1 - t0,
            optimizer_s=t2 - t1,
            extra=extra,
        )

    def _sync_count(self, *counters: str) -> int:
        """The sum of ``SyncedOptimizer.sync_stats`` counters (0 for a plain torch optimizer)."""
        stats = getattr(self.optimizer, "sync_stats", None)
        return sum(int(stats.get(name, 0)) for name in counters) if stats is not None else 0
