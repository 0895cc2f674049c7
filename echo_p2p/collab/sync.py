"""Keeps the trainers' states identical: ``hivemind.Optimizer`` plus a lineage check on every gradient round.

Owned here: ``SyncedOptimizer`` (the ``hivemind.Optimizer`` that ``make_collab_optimizer`` builds) and the
pure rules it applies (``choose_reference``, ``next_token``, ``parse_tag``); the hivemind averagers it builds
are ``echo_p2p.collab.averagers``. Called by ``echo_p2p.collab.optimizer`` only. Must not compute losses nor talk to anything but hivemind.

Why
---
hivemind keeps trainers' *epochs* together, not their *states*. Two trainers end up with different
parameters and Adam statistics whenever one epoch was not the same update on both: an all-reduce that
failed or timed out for one of them (each then applies its own gradients), a trainer that did an epoch
alone before it saw the other one, or a trainer one epoch behind whose round was matched with the other's
next round (hivemind tolerates a lag of one epoch, and gradient rounds do not compare epochs). hivemind's
state averaging does not repair this: it averages parameters only (not the optimizer statistics) and in the
background, so the trainers drift again in the next epoch.

How
---
Every trainer holds a *sync token*: a name for the lineage of its state (parameters, optimizer statistics,
epoch). It starts random. Each gradient round gathers ``{"epoch", "token"}`` from every member. Afterwards
every member applies the same rule to the same gathered data (``choose_reference``: highest epoch, then the
token most members hold, then the greatest token):

- a member whose tag is the reference applied the same averaged gradients to the same state as every other
  such member, so they all take the same new token ``next_token(token, new epoch, group's peer ids)``;
- any other member is out of sync: at its next ``step`` it discards its gradients and downloads the full
  state (parameters, optimizer statistics, epoch, token) from a peer (``load_state_from_peers``), with
  its own state sharing switched off meanwhile so that it never downloads from another out-of-sync peer;
- a member whose round failed while other trainers are known does the same (best effort: when no peer
  serves its state, the next round's comparison decides);
- a member whose averages arrived only in part (hivemind kept its own values for the missing parts) takes a
  lineage of its own and downloads nothing yet: the next shared round's reference rule decides which of the
  lineages the trainers keep, and only those off it download (a round can come back partial for every member
  at once: each downloading from the others, they refused each other's state as older than their own and
  the next round found no group until ``averaging_timeout``); except a member that joined with no samples
  (an idle trainer, weight 0): the others' values are that round's whole result and its own lack parts of
  it, so it downloads.

A trainer with no batch still takes part in the others' round of its epoch (``join_round_while_idle``): the
same averaged update, its weight the samples it accumulated (0 when none), so nobody waits for it and it
stays in their lineage.

So two trainers hold the same state after every epoch they averaged together (up to the all-reduce's float
rounding, ~1e-7 relative), and one failed round is repaired by the next step, or at the latest by the next
round they share. ``in_sync`` tells whether this trainer's last transition was such an agreed one.

The download is bounded: one attempt of at most ``load_state_timeout`` seconds per step (hivemind's own
``load_state_from_peers`` retries forever). It also fixes hivemind 1.1.12 ignoring ``client_mode`` (it
replaces any explicit value by the DHT's), stores a lone trainer's progress record less often
(``echo_p2p.collab.progress``) and schedules no gradient round while the trainer is alone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

import hivemind
import torch
from hivemind.optim.state_averager import TrainingStateAverager

from echo_p2p.collab.averagers import TAG_KEY, SyncTag, TaggedGradientAverager, TaggedStateAverager
from echo_p2p.collab.progress import PacedProgressTracker

logger = logging.getLogger(__name__)

NEVER = 2**62  # hivemind's ``average_state_every`` for "no state averaging" (epoch % NEVER is never 0)
LEAVE_POLL_S = 0.2  # how often a wait for a gradient round looks whether the trainer is leaving
EPOCH_MEMORY = (
    256  # epochs whose shared or sole state is remembered (``state_known``); more than any kept past
)


#: what ``SyncedOptimizer.sync_stats`` counts (epoch transitions by outcome, state downloads, idle and
#: non-finite rounds)
SYNC_STATS = ("agreed", "solo", "diverged", "failed_rounds", "resyncs", "resync_failures", "advanced", "partial",
              "idle_rounds", "nonfinite_rounds")  # fmt: skip


class _NoRound(Exception):
    """The gradient round an idle trainer joined did not complete: its epoch transition is abandoned."""


def parse_tag(value: Any) -> SyncTag | None:
    """A gathered ``{"epoch": int, "token": str}``; None when malformed or absent (e.g. an older peer)."""
    if not isinstance(value, Mapping):
        return None
    epoch, token = value.get("epoch"), value.get("token")
    if type(epoch) is not int or epoch < 0 or not isinstance(token, str) or not 0 < len(token) <= 64:
        return None
    return epoch, token


def choose_reference(tags: Iterable[SyncTag | None]) -> SyncTag | None:
    """The tag every member of a round syncs to: the highest epoch, then the tag most members hold, then
    the greatest token. Deterministic, so every member that gathered the same tags picks the same one."""
    counts = Counter(tag for tag in tags if tag is not None)
    if not counts:
        return None
    return max(counts, key=lambda tag: (tag[0], counts[tag], tag[1]))


def next_token(token: str, epoch: int, peer_ids: Iterable[str]) -> str:
    """The token of a state reached from ``token`` by epoch ``epoch``'s update, averaged among ``peer_ids``
    (just this trainer's id when it applied its own gradients)."""
    text = f"{token}|{epoch}|{','.join(sorted(peer_ids))}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fresh_token() -> str:
    """A token no other state has: for a state nobody else can hold (initial, or out of sync)."""
    return secrets.token_hex(16)


class SyncedOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` whose trainers re-synchronise their whole state after any irregular epoch
    (see the module docstring). Same arguments as ``hivemind.Optimizer``, except that ``client_mode`` is
    honoured (None: the DHT's) and the gradient averager is always this module's, built with
    ``grad_averager_opts`` (e.g. ``request_timeout``) instead of a ``grad_averager_factory``."""

    def __init__(
        self,
        *,
        dht: hivemind.DHT,
        client_mode: bool | None = None,
        grad_averager_opts: dict[str, Any] | None = None,
        leaving: threading.Event | None = None,
        lone_progress_interval: float = 0.0,
        **kwargs: Any,
    ) -> None:
        if "grad_averager_factory" in kwargs:
            raise TypeError("SyncedOptimizer builds its own gradient averager: pass grad_averager_opts")
        self._client_mode = dht.client_mode if client_mode is None else bool(client_mode)
        self._lone_progress_interval = lone_progress_interval
        # set when the trainer leaves: a gradient round still waited for is abandoned (the trainer applies its
        # own gradients and its step returns) instead of waiting out ``averaging_timeout``
        self.leaving = leaving if leaving is not None else threading.Event()
        self.sync_token = fresh_token()
        self.in_sync = False  # last epoch transition agreed with the group (or state just downloaded)
        #: epochs whose state every member of the round that left them held (all their tags equal ours)
        self.shared_epochs: deque[int] = deque(maxlen=EPOCH_MEMORY)
        self.sync_stats = dict.fromkeys(SYNC_STATS, 0)
        self._must_resync = False
        # while ``join_round_while_idle`` runs an epoch transition: the samples it joined with (its weight)
        self._idle_weight: int | None = None
        self._round_tags: dict[str, SyncTag | None] | None = None
        factory = functools.partial(TaggedGradientAverager, **(grad_averager_opts or {}))
        super().__init__(dht=dht, client_mode=None, grad_averager_factory=factory, **kwargs)
        assert self.grad_averager is not None, "SyncedOptimizer needs gradient averaging"
        self.grad_averager.tag_fn = self._tag_payload
        self.grad_averager.group_size_fn = lambda: self.tracker.global_progress.num_peers
        self._publish_tag()

    # ---- construction: honour client_mode (hivemind 1.1.12 overwrites an explicit value) ----
    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> PacedProgressTracker:
        self.client_mode = self._client_mode  # the first factory hivemind calls
        return PacedProgressTracker(
            dht=self.dht,
            prefix=self.run_id,
            target_batch_size=target_batch_size,
            client_mode=self.client_mode,
            status_loglevel=self.status_loglevel,
            lone_interval=self._lone_progress_interval,
            start=True,
            **kwargs,
        )

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        return TaggedStateAverager(
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    # ---- the sync tag ----
    @property
    def sync_tag(self) -> SyncTag:
        return self.local_epoch, self.sync_token

    def _tag_payload(self) -> dict[str, Any]:
        return {"epoch": self.local_epoch, "token": self.sync_token}

    def state_shared(self, epoch: int) -> bool:
        """Whether every member of the gradient round that left ``epoch`` held this trainer's state of it (all
        their tags equal): the other trainers, the publisher among them, held the same weights under that
        version. False for an epoch left alone, by a failed, partial or diverged round, or not left yet."""
        return epoch in self.shared_epochs

    @property
    def download_pending(self) -> bool:
        """Whether the last epoch transition found this trainer off the group's state and its next step (or
        catch-up) downloads theirs: the state it holds now is a lineage about to be replaced."""
        return self._must_resync

    def _publish_tag(self) -> None:
        self.state_averager.sync_tag = self.sync_tag

    # ---- epoch transitions ----
    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind's, except for a trainer that sees no other: hivemind pre-schedules a gradient round before
        every epoch and cancels it at the epoch when it is alone, so a lone trainer's averager looked for a
        group (DHT stores and reads through the DHT process) 3 times a second for nothing. Once another
        trainer's progress record is seen (``num_peers`` > 1), rounds are pre-scheduled as before; a round
        not pre-scheduled is begun at the epoch (hivemind's ``_begin_averaging_gradients``), and alone the
        epoch applies this trainer's own gradients, as after a cancelled round (a unit test compares it with
        plain AdamW)."""
        if self.tracker.global_progress.num_peers > 1:
            super()._maybe_schedule_gradient_averaging()

    def _update_global_epoch(self, grad_scaler: Any) -> None:
        self._round_tags = None
        before = self.sync_tag
        super()._update_global_epoch(grad_scaler)
        self._after_epoch(before)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control: Any) -> None:
        """hivemind's, remembering the tags gathered by a round that succeeded."""
        averaged = False
        try:
            if maybe_step_control is not None:
                gathered = self._round_result(maybe_step_control)
                if not self._averaged_gradients_finite():
                    self.sync_stats["nonfinite_rounds"] += 1
                    logger.warning(
                        "the gradient round of epoch %d averaged to non-finite values: not applied",
                        self.local_epoch,
                    )
                    raise FloatingPointError("the round's averaged gradients are not finite")
                logger.log(self.status_loglevel, f"Averaged gradients with {len(gathered)} peers")
                self._load_averaged_gradients_into_optimizer_()
                averaged = True
                self._round_tags = {str(peer): parse_tag(value) for peer, value in gathered.items()}
            else:
                logger.log(self.status_loglevel, "Skipped averaging: there are no other peers")
        except BaseException as e:
            logger.log(self.status_loglevel, f"Averaging gradients failed with {e!r}")
        if not averaged:
            if self._idle_weight is not None:
                raise _NoRound("the gradient round an idle trainer joined did not complete")
            self._load_local_gradients_into_optimizer()

    def _averaged_gradients_finite(self) -> bool:
        """Whether every averaged gradient a round left in the averager's buffers is finite. hivemind 1.1.12's
        ``TensorPartReducer`` divides each part by the sum of its senders' weights: when the only sender of a
        part that reached its host joined with weight 0 (an idle trainer, ``join_round_while_idle``, or one
        tagging along before a download) and the other failed, the part is 0/0 (a test plays it on hivemind's
        own reducer). Such a round is treated as failed (own gradients, or no update for an idle trainer,
        and a download of the others' state), never applied: applied, it made the weights NaN."""
        with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
            return all(bool(torch.isfinite(tensor).all()) for tensor in averaged)

    def _round_result(self, control: Any) -> Any:
        """The gathered data of a gradient round, waited for at most ``averaging_timeout`` seconds, or less:
        once ``leaving`` is set the round is cancelled and ``TimeoutError`` raised at the next poll."""
        deadline = time.monotonic() + self.averaging_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                return control.result(max(0.0, min(LEAVE_POLL_S, remaining)))
            except TimeoutError:
                if remaining <= LEAVE_POLL_S:
                    raise
                if self.leaving.is_set():
                    control.cancel()
                    raise TimeoutError("the trainer is leaving: gradient round abandoned") from None

    def _after_epoch(self, before: SyncTag) -> None:
        me = str(self.dht.peer_id)
        epoch = self.local_epoch
        tags = self._round_tags
        self._round_tags = None
        if tags is None or me not in tags:  # no round: alone, or the round failed
            self.sync_token = next_token(before[1], epoch, [me])
            others = self.tracker.global_progress.num_peers > 1
            if others:
                self.sync_stats["failed_rounds"] += 1
                self._must_resync = True  # best effort; the next shared round decides otherwise
            else:
                self.sync_stats["solo"] += 1
            self.in_sync = not others
        elif tags[me] is None:  # our averages arrived only in part (``TaggedGradientAverager.PARTIAL``)
            # a lineage of our own, and no download now: every member of a round that came back partial for
            # all of them would download at once from the others, each refusing the others' state as older
            # than its own, and the next round would wait for members busy downloading. The next shared
            # round's reference rule picks one lineage, and only the members off it download.
            logger.info(
                "gradient round of epoch %d arrived only in part: a lineage of our own; the next shared round "
                "decides which state the trainers keep",
                epoch,
            )
            self.sync_token = fresh_token()
            self.in_sync = False
            self.sync_stats["partial"] += 1
            if self._idle_weight == 0:
                # except a member that joined with nothing (idle, weight 0): the others' values are the round's
                # whole result and ours lack parts of it, so its lineage must never be kept: download theirs
                # (the trainer's idle catch-up, or its next step). Left waiting for a next round, an idle
                # trainer whose partner paused held parameters nobody else had, under the partner's epoch.
                self._must_resync = True
        else:
            reference = choose_reference(tags.values())
            if tags[me] == before == reference:
                self.sync_token = next_token(before[1], epoch, tags)
                self.in_sync = True
                self.sync_stats["agreed"] += 1
                if len(tags) > 1 and all(tag == reference for tag in tags.values()):
                    self.shared_epochs.append(before[0])  # every member held our state of that epoch
            else:
                logger.info(
                    "trainer state out of sync at epoch %d (ours %s, the group's %s): will download it",
                    epoch,
                    before,
                    reference,
                )
                self.sync_token = fresh_token()
                self.in_sync = False
                self._must_resync = True
                self.sync_stats["diverged"] += 1
        self._publish_tag()

    def _should_load_state_from_peers(self) -> bool:
        if self._must_resync:
            self._must_resync = False
            return True
        return super()._should_load_state_from_peers()

    # ---- while idle: joining the others' rounds, catching up ----
    def join_round_while_idle(self) -> bool:
        """For a trainer with nothing to step on, level with the swarm: take part in the other trainers'
        gradient round of this epoch with the gradients it accumulated so far (weight 0 when none, hivemind's
        weight is the samples accumulated) and apply the same averaged update, so they never wait in a round
        for a trainer that has no batch (after a state download it often has none for seconds: the samplers
        still route to the others) and it stays in their lineage; a round pre-scheduled by its last step and
        then never begun left the others' averages partial. As hivemind's ``step`` does, it joins matchmaking
        once the epoch's end is near (pre-scheduled round) and begins the round when the epoch is due
        (``ready_to_update_epoch``: the swarm's samples reach the target, or their estimated time passed),
        provided the others accumulated samples for it. True when it moved to the next epoch. A round that does not
        complete changes nothing (no update of our own: the others moved without us, and the next step or
        catch-up downloads their state)."""
        tracker = self.tracker
        if (
            self.auxiliary
            or self._must_resync
            or self.local_epoch != tracker.global_epoch
            or tracker.global_progress.num_peers <= 1
        ):
            return False
        self._maybe_schedule_gradient_averaging()
        others = tracker.global_progress.samples_accumulated - self.grad_averager.local_samples_accumulated
        if not tracker.ready_to_update_epoch or others <= 0:
            return False  # a round of trainers that all hold nothing would average over a weight of 0
        before = self.local_epoch
        self._idle_weight = self.grad_averager.local_samples_accumulated
        try:
            self._update_global_epoch(None)
        except _NoRound as exc:
            logger.log(self.status_loglevel, f"{exc}: staying at epoch {before}")
            control, self.scheduled_grads = self.scheduled_grads, None
            if control is not None and not control.done():
                control.cancel()
            tracker.report_local_progress(self.local_epoch, self.grad_averager.local_samples_accumulated)
            return False
        finally:
            self._idle_weight = None
        self.sync_stats["idle_rounds"] += 1
        return self.local_epoch > before

    def behind_swarm(self) -> bool:
        """True when another trainer reports a later epoch than ours, or our last epoch asked for a state
        download that no step has done yet."""
        return self._must_resync or self.tracker.global_epoch > self.local_epoch

    def catch_up(self, force: bool = False) -> bool:
        """Download the swarm's state now, outside ``step``, when ``behind_swarm`` (or ``force``: the caller
        knows better than the progress records, e.g. a live trainer announces a newer version): for a trainer
        that has nothing to step on *because* it is behind (an async trainer refuses rollouts of versions it
        has not reached; a sync trainer asks for a version nobody serves any more), ``step`` would never come.
        True when a state was loaded."""
        if not force and not self.behind_swarm():
            return False
        self._must_resync = False
        logger.info(
            "trainer at epoch %d is behind the swarm (epoch %d): downloading the state",
            self.local_epoch,
            self.tracker.global_epoch,
        )
        return self.load_state_from_peers()

    def advance_to(self, epoch: int) -> bool:
        """Take ``epoch`` as this trainer's own, keeping its parameters and statistics: for a trainer behind a
        version that no live trainer can give it any more (the one ahead left). A new lineage: a fresh token,
        no accumulated gradient. False (nothing done) when ``epoch`` is not ahead of ours."""
        if epoch <= self.local_epoch:
            return False
        logger.warning(
            "trainer at epoch %d: no live trainer holds the swarm's state; continuing from its own as epoch %d",
            self.local_epoch,
            epoch,
        )
        self.state_averager.local_epoch = epoch
        self.sync_token, self.in_sync, self._must_resync = fresh_token(), False, False
        self.grad_averager.reset_accumulated_grads_()
        self.tracker.report_local_progress(local_epoch=epoch, samples_accumulated=0)
        if not self.client_mode:
            self.state_averager.state_sharing_priority = epoch
            self.grad_averager.state_sharing_priority = epoch
        self.sync_stats["advanced"] += 1
        self._publish_tag()
        return True

    # ---- bounded state download ----
    def load_state_from_peers(self, **kwargs: Any) -> bool:
        """Download the state (parameters, optimizer statistics, epoch, sync token) from the peer with the
        highest priority, in one attempt of at most ``load_state_timeout`` seconds. True when loaded; on
        failure the caller's next step tries again if still out of sync."""
        if self.scheduled_grads is not None and not self.scheduled_grads.done():
            self._tag_along_with_zero_weight(self.scheduled_grads)
            self.scheduled_grads = None
        self.state_averager.step(wait_for_delayed_updates=True)
        sharing = self.state_averager.allow_state_sharing
        if sharing:
            self.state_averager.allow_state_sharing = False  # never serve a state we are replacing
        metadata = None
        try:
            with self.tracker.pause_updates():
                try:
                    metadata = self.state_averager.load_state_from_peers(
                        timeout=self.load_state_timeout, **kwargs
                    )
                except Exception as e:  # a timeout or a broken peer: try again at a later step
                    logger.warning("could not load the trainers' state from peers: %r", e)
                if metadata is not None:
                    self._adopt(metadata)
                self.tracker.report_local_progress(local_epoch=self.local_epoch, samples_accumulated=0)
                if not self.client_mode:
                    self.state_averager.state_sharing_priority = self.local_epoch
                    self.grad_averager.state_sharing_priority = self.local_epoch
                self.grad_averager.reset_accumulated_grads_()
        finally:
            if sharing:
                self.state_averager.allow_state_sharing = True
        self.sync_stats["resyncs" if metadata is not None else "resync_failures"] += 1
        return metadata is not None

    def _adopt(self, metadata: dict) -> None:
        """Take the downloaded state's token (when it describes the downloaded epoch), then hivemind's
        catch-up: a donor one epoch behind the swarm moves us to the swarm's epoch (a new lineage)."""
        tag = parse_tag(metadata.get(TAG_KEY))
        exact = tag is not None and tag[0] == self.local_epoch
        self.sync_token = tag[1] if exact else fresh_token()
        global_epoch = self.tracker.global_epoch
        if global_epoch - 1 <= self.local_epoch < global_epoch:
            logger.log(self.status_loglevel, f"Catching up with collaboration step {global_epoch}")
            self.state_averager.local_epoch = global_epoch
            self.sync_token, exact = fresh_token(), False
        self.in_sync = exact
        self._publish_tag()
