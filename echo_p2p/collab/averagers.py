"""The hivemind averagers a ``SyncedOptimizer`` builds: gradient rounds that carry each member's sync tag, a
round's group size, and a state download loaded only when it is whole.

Owned here: ``TaggedGradientAverager`` (hivemind's ``GradientAverager`` whose rounds all-gather the sync tag,
report a round that arrived in part, and are assembled as soon as every known trainer joined: ``group_size``)
and ``TaggedStateAverager`` (hivemind's ``TrainingStateAverager`` serving the tag with the state and loading
a downloaded state in one bounded attempt, checked against its metadata: ``optimizer_tensors_named``).
Built by ``echo_p2p.collab.sync.SyncedOptimizer`` only, which owns what the tags mean (docs/protocol.md).
Parts of both run in hivemind's averager child processes: what they hand back is what the pipe carries.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import typing
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager, load_optimizer_state
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import achain, anext, as_aiter

logger = logging.getLogger(__name__)

SyncTag = tuple[int, str]  # (epoch, token)
TAG_KEY = "echo_sync"  # key of the tag in a downloaded state's metadata


class TaggedGradientAverager(GradientAverager):
    """Sends the optimizer's sync tag with every gradient round (hivemind's all-gather), and reports a round
    whose averages arrived only in part as *not agreed* for this member.

    hivemind finishes an all-reduce in which some part's average never reached a member by keeping that
    member's own values for the part (``TensorPartContainer.register_failed_reducer``, logged as "Averaging:
    received 48.7% results") and reports success: that member then applies other gradients than the rest
    of its group under the same epoch. Seen as a 4e-3 parameter difference between two trainers whose every
    round had "agreed". Such a member's own entry in the round's gathered tags is replaced by a marker no
    tag parses to, so ``SyncedOptimizer._after_epoch`` gives it a lineage of its own.
    (This runs in the averager's child process; the gathered dict is what reaches the trainer's process.)"""

    tag_fn: Any = None
    #: how many trainers the next round is for (the optimizer's count of live progress records); None: unknown
    group_size_fn: Any = None
    PARTIAL = {"partial": True}
    #: rounds remembered as finished, and as declined (their parts are answered at once, not waited on)
    ROUNDS_KEPT = 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._partial_groups: set = set()  # ids of rounds whose averages arrived in part (averager process)
        self._finished_groups: collections.deque = collections.deque(maxlen=self.ROUNDS_KEPT)
        # rounds that counted us but we never learned of (answered, their members told: ``rpc_aggregate_part``)
        self._declined_groups: collections.deque = collections.deque(maxlen=self.ROUNDS_KEPT)
        self._declining: set = set()  # their ``_decline_round`` tasks
        super().__init__(*args, **kwargs)

    def schedule_step(self, scheduled_time: float | None = None, **kwargs: Any):
        if self.tag_fn is not None and "gather" not in kwargs:
            kwargs["gather"] = self.tag_fn()
        if self.group_size_fn is not None:
            # sent before the step through the same pipe: the averager process applies it first
            self._outer_pipe.send(("_set_group_size", [group_size(self.group_size_fn())], {}))
        return super().schedule_step(scheduled_time, **kwargs)

    async def _set_group_size(self, size: int | None) -> None:
        """(averager process) The group a round's leader assembles as soon as it is this large, instead of at
        the end of ``min_matchmaking_time``: every trainer of the run. hivemind's ``target_group_size``
        (None: always wait out the matchmaking time), set per round because the number of trainers changes."""
        self._matchmaking.target_group_size = size

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any):
        try:
            gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        finally:
            self._finished_groups.append(group_info.group_id)
        if group_info.group_id in self._partial_groups:
            self._partial_groups.discard(group_info.group_id)
            gathered = {**gathered, self.peer_id: self.PARTIAL}
        return gathered

    async def _run_allreduce_inplace_(
        self, tensors: Any, group_info: Any, group_id: Any = None, **kwargs: Any
    ):
        await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        group_id = group_info.group_id if group_id is None else group_id
        runner = self._running_groups[group_id].result()
        if runner.tensor_part_container.failed_size:
            self._partial_groups.add(group_info.group_id)

    async def rpc_aggregate_part(
        self,
        stream: typing.AsyncIterator[averaging_pb2.AveragingData],  # noqa: UP006 (hivemind reads typing's form)
        context: P2PContext,
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:  # noqa: UP006
        """hivemind's, except for the part of a round this averager was counted in but never learned of: the
        leader accepted its join request and began the round, but the stream that carried the answer ended
        first (hivemind's stream reader takes a connection closed mid-stream for the stream's end, so the
        requester sees a refusal: "failed to request potential leader"). hivemind then waits on such a part
        until a round of its own is registered, and keeps looking for a group until its step's deadline
        (``averaging_timeout``), while the round that counted it waits for its parts (``next_chunk_timeout``
        as a sender, twice that as a reducer) and comes back partial: in a soak, 9 s of one trainer searching
        and 6 s of the other's round, two publish gaps of 8.7 and 8.3 s in a row (docs/reliability.md).

        Now such a part is answered at once (hivemind's ``BAD_GROUP_ID``: the round stops waiting on this
        averager as a reducer), its sender is told that this averager takes no part (``_decline_round``: the
        round stops waiting on it as a sender too), and this averager's own search is ended, so its step fails
        at once (the trainer applies its own gradients and, its state now off the others', downloads theirs).
        Counted in an unknown round means: looking for a group, no leader accepted it, it assembled no group,
        the sender is a leader it asked to join in this search, the round is not one of its recent ones, and
        none registered within ``request_timeout`` (a leader's answer that is merely late). The other members' parts of such a round get the same answers."""
        request = await anext(stream)
        group_id = request.group_id
        if group_id in self._finished_groups:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)  # a late part of a past round
            return
        if group_id not in self._running_groups and group_id not in self._declined_groups:
            if await self._counted_in_unknown_round_after_grace(group_id, context.remote_id):
                logger.warning(
                    "gradient round: %s counted this trainer in a round it never learned of (its answer to "
                    "our join request was lost): ending our search for a group now",
                    context.remote_id,
                )
                self._declined_groups.append(group_id)
                self._end_search(
                    MatchmakingException(f"{context.remote_id} counted us in a round we never learned of")
                )
        if group_id in self._declined_groups:
            task = asyncio.create_task(self._decline_round(context.remote_id, group_id))
            self._declining.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self._declining.discard)
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _counted_in_unknown_round_after_grace(self, group_id: bytes, sender: Any) -> bool:
        """(averager process) ``_counted_in_unknown_round``, still so after ``request_timeout`` s in which no
        round registered (a leader's answer that is merely late registers ``group_id``)."""
        if not self._counted_in_unknown_round(sender):
            return False
        try:
            await asyncio.wait_for(self._pending_groups_registered.wait(), self._matchmaking.request_timeout)
        except asyncio.TimeoutError:
            pass
        return group_id not in self._running_groups and self._counted_in_unknown_round(sender)

    async def _decline_round(self, peer_id: Any, group_id: bytes) -> None:
        """(averager process) Tell ``peer_id``'s run of round ``group_id`` that this averager sends no parts: a
        first message that is not a part makes hivemind's ``AllReduceRunner`` ban the sender at once, so its
        reducer stops waiting for our parts (else: ``next_chunk_timeout``). Best effort, bounded."""
        message = averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED, group_id=group_id)
        try:
            stub = self.get_stub(self._p2p, peer_id, namespace=self.prefix)

            async def exchange() -> None:
                stream = await stub.rpc_aggregate_part(as_aiter(message))
                async for _ in stream:
                    break  # its runner answers with an error code: we are out of its round

            await asyncio.wait_for(exchange(), 2 * self._matchmaking.request_timeout)
        except Exception as e:  # the round may be over already, or the peer gone
            logger.debug("could not decline round %s at %s: %r", group_id.hex(), peer_id, e)

    def _end_search(self, reason: Exception) -> None:
        """(averager process) Fail the step that is looking for a group, and end its search: the step first,
        so that hivemind's ``_step`` sees it done and does not look again. (``StepControl.cancel`` from the
        averager's side never reaches the trainer's process in hivemind 1.1.12: there it cancels the trigger
        and cancel futures the averager already finished, fails, and the step stays pending.)"""
        step = self._matchmaking.step_control
        if step is not None and not step.done():
            step.set_exception(reason)
        if not self._matchmaking.assembled_group.done():
            self._matchmaking.assembled_group.set_exception(reason)

    def _counted_in_unknown_round(self, sender: Any) -> bool:
        """(averager process) Looking for a group, with no leader that accepted us and no group we assembled
        (no round we take part in can be under way), and ``sender`` is a leader this search asked to join:
        only such a peer can have counted us. (A stranger's part of a made-up round must not end our search:
        else any peer could fail every round of a trainer for the price of one message each.)"""
        matchmaking = self._matchmaking
        step = matchmaking.step_control
        return (
            step is not None
            and step.stage == AveragingStage.LOOKING_FOR_GROUP
            and matchmaking.current_leader is None
            and not matchmaking.assembled_group.done()
            and any(peer == sender for peer, _ in matchmaking.potential_leaders.past_attempts)
        )


def group_size(trainers: int) -> int | None:
    """The size at which a gradient round's group is complete, from the number of trainers the progress
    records show (this one included): all of them; None below 2 (alone there is no group to wait for).

    Without it hivemind assembles every group at the end of ``min_matchmaking_time`` (1 s), whoever joined:
    with one batch per epoch, 1.3 s of a trainer's 1.8 s step went to waiting for that clock (a soak's median,
    docs/reliability.md). A trainer the records do not show yet finds the group full and averages alone for
    one round (it then downloads the others' state: ``SyncedOptimizer._after_epoch``); one they still show
    after it left makes the group wait out the matchmaking time, as before."""
    return trainers if trainers >= 2 else None


def optimizer_tensors_named(optimizer_metadata: Any) -> int | None:
    """How many tensors a downloaded state's optimizer metadata (hivemind's ``dump_optimizer_state`` list)
    names: its tensor entries must be indexed 0, 1, 2, ... in order, as ``dump_optimizer_state`` writes them.
    None when it is not such a list (a stranger's or a broken donor's state: never loaded)."""
    if not isinstance(optimizer_metadata, list):
        return None
    named = 0
    for elem in optimizer_metadata:
        if not isinstance(elem, dict):
            return None
        if elem.get("type") == "tensor":
            if elem.get("index") != named or type(elem.get("index")) is not int:
                return None
            named += 1
    return named


class TaggedStateAverager(TrainingStateAverager):
    """Serves the sync tag with the state; loads a state in one bounded attempt and says what it loaded."""

    sync_tag: SyncTag | None = None  # set by the optimizer; read by the state-serving thread

    def get_current_state(self):
        tag = self.sync_tag  # read first: a tag older than the tensors is caught by the epoch check on load
        metadata, tensors, infos = super().get_current_state()
        if tag is not None:
            metadata[TAG_KEY] = {"epoch": tag[0], "token": tag[1]}
        return metadata, tensors, infos

    def load_state_from_peers(self, **kwargs: Any) -> dict | None:
        """``TrainingStateAverager.load_state_from_peers`` (hivemind 1.1.12) returning the metadata of the
        state it applied, or None when it applied none."""
        opt_parameters = tuple(p for group in self.optimizer.param_groups for p in group["params"])
        main_parameters_and_extras = (*opt_parameters, *self.extra_tensors)
        loaded = DecentralizedAverager.load_state_from_peers(self, **kwargs)
        if loaded is None:
            return None
        metadata, flat_tensors = loaded
        if not isinstance(metadata, dict) or type(metadata.get("epoch")) is not int:
            logger.warning("ignoring a downloaded state without an epoch")
            return None
        if metadata["epoch"] < self.local_epoch:
            logger.warning("ignoring a downloaded state of epoch %d < ours", metadata["epoch"])
            return None
        count = len(main_parameters_and_extras)
        named = optimizer_tensors_named(metadata.get("optimizer_metadata"))
        if named is None or len(flat_tensors) != count + named:
            # fewer tensors than the metadata names: a download stream cut short (hivemind 1.1.12's stream
            # reader takes a connection closed mid-stream, ``IncompleteReadError``, for the stream's end, so a
            # reset download arrives truncated with no error), or a broken or hostile donor. Loaded, it failed
            # deep in hivemind's ``load_optimizer_state`` with IndexError (a restarted trainer's download in
            # tests/integration/test_churn.py)
            logger.warning(
                "ignoring a downloaded state with %d tensors: its metadata names %s (%d parameters and extras, "
                "then the optimizer's)",
                len(flat_tensors),
                "malformed optimizer statistics" if named is None else count + named,
                count,
            )
            return None
        ours_and_theirs = zip(main_parameters_and_extras, flat_tensors[:count], strict=True)
        if any(tuple(a.shape) != tuple(b.shape) for a, b in ours_and_theirs):
            # checked before anything is loaded: a failed copy after the statistics left a half-loaded state
            logger.warning("ignoring a downloaded state whose parameters have other shapes than ours")
            return None
        with torch.no_grad(), self.lock_averaged_tensors:
            try:
                load_optimizer_state(self.optimizer, metadata["optimizer_metadata"], flat_tensors[count:])
            except (StopIteration, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                logger.warning("ignoring a downloaded state with inconsistent optimizer statistics: %r", e)
                return None
            for local, remote in zip(main_parameters_and_extras, flat_tensors[:count], strict=True):
                local.copy_(remote, non_blocking=True)
        if self.offload_optimizer:
            self._apply_optimizer_parameters_()
        if not self.reuse_tensors:
            self._load_local_tensors_into_averager_()
        self.local_epoch = metadata["epoch"]
        self._update_scheduler()
        return metadata
