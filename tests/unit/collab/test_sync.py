"""The trainers' sync check (``collab.sync``): tags, the reference rule, and what an epoch transition decides."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from echo_p2p.collab.sync import (
    EPOCH_MEMORY,
    SYNC_STATS,
    SyncedOptimizer,
    choose_reference,
    fresh_token,
    next_token,
    parse_tag,
)


def test_parse_tag_accepts_only_an_epoch_and_a_token() -> None:
    assert parse_tag({"epoch": 3, "token": "ab"}) == (3, "ab")
    for bad in (None, [3, "ab"], {"epoch": True, "token": "ab"}, {"epoch": -1, "token": "ab"},
                {"epoch": 3, "token": ""}, {"epoch": 3, "token": "x" * 65}, {"epoch": 3}):  # fmt: skip
        assert parse_tag(bad) is None, bad


def test_reference_is_highest_epoch_then_majority_then_greatest_token() -> None:
    assert choose_reference([]) is None and choose_reference([None]) is None
    assert choose_reference([(3, "a"), (4, "b"), None]) == (4, "b")
    assert choose_reference([(4, "a"), (4, "b"), (4, "a")]) == (4, "a")
    assert choose_reference([(4, "a"), (4, "b")]) == choose_reference([(4, "b"), (4, "a")]) == (4, "b")


def test_next_token_is_deterministic_and_depends_on_everything() -> None:
    t = next_token("tok", 5, ["B", "A"])
    assert t == next_token("tok", 5, ["A", "B"])
    assert (
        len(
            {t, next_token("tok", 6, ["A", "B"]), next_token("tok", 5, ["A"]), next_token("x", 5, ["A", "B"])}
        )
        == 4
    )
    assert fresh_token() != fresh_token()


class _Fake(SyncedOptimizer):
    """The decision logic of ``SyncedOptimizer`` without hivemind: an epoch, a peer id and a peer count."""

    def __init__(self, peer_id: str, epoch: int, token: str, num_peers: int) -> None:  # no super(): no swarm
        self.dht = SimpleNamespace(peer_id=peer_id)
        self.tracker = SimpleNamespace(
            global_progress=SimpleNamespace(num_peers=num_peers), global_epoch=epoch
        )
        self.state_averager = SimpleNamespace(local_epoch=epoch, sync_tag=None)
        self.sync_token, self.in_sync, self._must_resync, self._round_tags = token, False, False, None
        self._idle_weight = None
        self.shared_epochs = deque(maxlen=EPOCH_MEMORY)
        self.sync_stats = dict.fromkeys(SYNC_STATS, 0)

    def __del__(self) -> None:  # hivemind's would shut a swarm down
        pass

    def transition(self, tags: dict | None) -> None:
        before = self.sync_tag
        self.state_averager.local_epoch += 1
        self._round_tags = tags
        self._after_epoch(before)


def test_members_that_agree_take_the_same_new_token_and_the_others_resync() -> None:
    from echo_p2p.collab.optimizer import CollabTrainerStep

    a, b, c = _Fake("A", 4, "t", 3), _Fake("B", 4, "t", 3), _Fake("C", 4, "other", 3)
    tags = {"A": (4, "t"), "B": (4, "t"), "C": (4, "other")}
    for opt in (a, b, c):
        opt.transition(dict(tags))
    assert a.sync_token == b.sync_token == next_token("t", 5, ["A", "B", "C"])
    assert a.in_sync and b.in_sync and not (a._must_resync or b._must_resync)
    assert not c.in_sync and c._must_resync and c.sync_token not in ("other", a.sync_token)
    assert c.state_averager.sync_tag == (5, c.sync_token)  # served with the state from now on
    # until that download, its trainer publishes nothing (``CollabTrainerStep.download_pending``)
    assert c.download_pending and not a.download_pending
    assert CollabTrainerStep(learner=None, optimizer=c).download_pending
    assert c._should_load_state_from_peers() and not c._must_resync  # one download per detection
    assert not c.download_pending
    assert not CollabTrainerStep(learner=None, optimizer=SimpleNamespace()).download_pending  # plain torch


def test_a_trainer_one_epoch_behind_resyncs_even_with_the_same_token() -> None:
    a, b = _Fake("A", 5, "t", 2), _Fake("B", 4, "t", 2)
    tags = {"A": (5, "t"), "B": (4, "t")}
    a.transition(dict(tags))
    b.transition(dict(tags))
    assert a.in_sync and not a._must_resync
    assert not b.in_sync and b._must_resync


def test_a_failed_round_with_peers_resyncs_and_a_lone_trainer_does_not() -> None:
    failed, alone = _Fake("A", 2, "t", 2), _Fake("A", 2, "t", 1)
    failed.transition(None)
    alone.transition(None)
    assert failed._must_resync and not failed.in_sync and failed.sync_stats["failed_rounds"] == 1
    assert not alone._must_resync and alone.in_sync and alone.sync_stats["solo"] == 1
    assert failed.sync_token == alone.sync_token == next_token("t", 3, ["A"])
    missing = _Fake("A", 2, "t", 2)
    missing.transition({"B": (2, "t")})  # a gathered dict without us counts as a failed round
    assert missing._must_resync


class _Downloading(_Fake):
    """Records the state downloads ``catch_up`` asks for; each one lands on ``donor_epoch`` (or fails)."""

    def __init__(self, epoch: int, global_epoch: int, donor_epoch: int | None) -> None:
        super().__init__("A", epoch, "t", 2)
        self.tracker.global_epoch = global_epoch
        self.donor_epoch, self.downloads = donor_epoch, 0

    def load_state_from_peers(self, **kwargs) -> bool:
        self.downloads += 1
        if self.donor_epoch is None:
            return False
        self.state_averager.local_epoch = self.donor_epoch
        return True


def test_an_idle_trainer_behind_the_swarm_catches_up_and_one_level_with_it_does_not() -> None:
    behind = _Downloading(epoch=6, global_epoch=12, donor_epoch=12)
    assert behind.behind_swarm() and behind.catch_up()
    assert behind.downloads == 1 and behind.local_epoch == 12 and not behind.behind_swarm()
    assert not behind.catch_up() and behind.downloads == 1  # level with the swarm: nothing to do

    level = _Downloading(epoch=6, global_epoch=6, donor_epoch=6)
    assert not level.behind_swarm() and not level.catch_up() and level.downloads == 0
    level.transition(None)  # a failed round among two trainers asks for a download at the next chance
    level.tracker.global_epoch = level.local_epoch
    assert level.behind_swarm() and level.catch_up() and level.downloads == 1
    assert not level._must_resync

    failing = _Downloading(epoch=6, global_epoch=9, donor_epoch=None)  # nobody serves the state
    assert not failing.catch_up() and failing.downloads == 1
    assert failing.behind_swarm()  # still behind: the trainer tries again later
    assert not failing.catch_up() and failing.downloads == 2


def test_members_whose_averages_arrived_in_part_keep_their_states_until_the_next_round_picks_one() -> None:
    """A member whose averages arrived only in part takes a lineage of its own and downloads nothing yet; the
    next shared round's reference rule picks one lineage and only the members off it download. When the round
    came back partial for both trainers (the soak's stall: both downloaded at once, each refused the other's
    state as older than its own), exactly one of them downloads after the next round."""
    from echo_p2p.collab.averagers import TaggedGradientAverager
    from echo_p2p.collab.sync import parse_tag

    partial = parse_tag(TaggedGradientAverager.PARTIAL)
    for partial_members in (["B"], ["A", "B"]):
        a, b = _Fake("A", 4, "t", 2), _Fake("B", 4, "t", 2)
        for opt in (a, b):
            view = {"A": (4, "t"), "B": (4, "t")}  # its own view of the round
            if opt.dht.peer_id in partial_members:
                view[opt.dht.peer_id] = partial
            opt.transition(view)
        for opt in (a, b):
            mine = opt.dht.peer_id in partial_members
            assert opt.in_sync is not mine and not opt._must_resync and not opt.behind_swarm()
            assert opt.sync_stats["partial"] == int(mine)
        assert a.sync_token != b.sync_token  # a partial state is never served as the other's lineage
        # the next shared round: both tags gathered; one lineage is the reference, the other downloads
        tags = {"A": a.sync_tag, "B": b.sync_tag}
        keeper = max(("A", "B"), key=lambda peer: tags[peer][1])
        agreed = {opt.dht.peer_id: opt.sync_stats["agreed"] for opt in (a, b)}
        a.transition(dict(tags))
        b.transition(dict(tags))
        downloads = {opt.dht.peer_id for opt in (a, b) if opt._must_resync}
        assert downloads == {"A", "B"} - {keeper}, (partial_members, keeper, downloads)
        kept = a if keeper == "A" else b
        assert kept.in_sync and kept.sync_stats["agreed"] == agreed[keeper] + 1


def test_an_idle_member_whose_averages_arrived_in_part_downloads_the_others_state() -> None:
    """An idle trainer joins the others' round with weight 0: their values are the round's whole result and
    its own lack parts of it, so it downloads (the trainer's idle catch-up) instead of keeping a lineage the
    next round could pick; one that joined with samples keeps a lineage of its own like a stepping member."""
    from echo_p2p.collab.averagers import TaggedGradientAverager
    from echo_p2p.collab.sync import parse_tag

    partial = parse_tag(TaggedGradientAverager.PARTIAL)
    for weight, downloads in ((0, True), (3, False)):
        idle = _Fake("B", 4, "t", 2)
        idle._idle_weight = weight
        idle.transition({"A": (4, "t"), "B": partial})
        assert not idle.in_sync and idle.sync_stats["partial"] == 1
        assert idle._must_resync is downloads and idle.behind_swarm() is downloads, weight


class _Round:
    """A pending gradient round (hivemind's ``StepControl``): ``result`` blocks until ``ready`` is set."""

    def __init__(self) -> None:
        import threading

        self.ready = threading.Event()
        self.cancelled = False

    def result(self, timeout: float):
        if not self.ready.wait(timeout):
            raise TimeoutError
        return {"peer": {"epoch": 1, "token": "t"}}

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_trainer_that_leaves_abandons_the_gradient_round_it_waits_for_at_once() -> None:
    """Stopping a trainer used to wait out ``averaging_timeout`` (~10 s on the tiny model) in a round that
    would fail (its peer had left): now the round is cancelled within a poll of the stop."""
    import threading
    import time

    leaving = threading.Event()
    optimizer = SimpleNamespace(averaging_timeout=30.0, leaving=leaving)
    pending = _Round()
    threading.Timer(0.3, leaving.set).start()
    t0 = time.monotonic()
    try:
        SyncedOptimizer._round_result(optimizer, pending)
    except TimeoutError as exc:
        assert "leaving" in str(exc)
    else:
        raise AssertionError("a round abandoned on leaving must not return a result")
    assert time.monotonic() - t0 < 1.5 and pending.cancelled

    # not leaving: the round's result, or TimeoutError after averaging_timeout, with nothing cancelled
    done = _Round()
    threading.Timer(0.3, done.ready.set).start()
    assert SyncedOptimizer._round_result(
        SimpleNamespace(averaging_timeout=5.0, leaving=threading.Event()), done
    )
    late = _Round()
    t0 = time.monotonic()
    try:
        SyncedOptimizer._round_result(SimpleNamespace(averaging_timeout=0.5, leaving=threading.Event()), late)
    except TimeoutError:
        pass
    else:
        raise AssertionError("a round that never ends times out")
    assert 0.45 < time.monotonic() - t0 < 2 and not late.cancelled and not done.cancelled


def test_an_epochs_state_is_shared_only_when_every_member_of_the_round_that_left_it_held_it() -> None:
    """What the sender guard's replays rely on: the weights this trainer kept of an epoch are the publisher's
    only when every member of the round that left that epoch held the same state."""
    a, b = _Fake("A", 4, "t", 2), _Fake("B", 4, "t", 2)
    tags = {"A": (4, "t"), "B": (4, "t")}
    a.transition(dict(tags))
    b.transition(dict(tags))
    assert a.state_shared(4) and b.state_shared(4) and not a.state_shared(5)  # 5: no round has left it yet
    # A is the reference, C's state differs: A stays in sync, but C (maybe the publisher) had other weights
    a2, c = _Fake("A", 4, "t", 2), _Fake("C", 4, "other", 2)
    mixed = {"A": (4, "t"), "B": (4, "t"), "C": (4, "other")}
    a2.transition(dict(mixed))
    c.transition(dict(mixed))
    assert a2.in_sync and not a2.state_shared(4) and not c.state_shared(4)
    alone, failed, partial = _Fake("A", 4, "t", 1), _Fake("A", 4, "t", 2), _Fake("A", 4, "t", 2)
    alone.transition(None)
    failed.transition(None)
    partial.transition({"A": None, "B": (4, "t")})  # our averages arrived only in part
    assert not (alone.state_shared(4) or failed.state_shared(4) or partial.state_shared(4))
    assert not (alone.state_shared(5) or failed.state_shared(5) or partial.state_shared(5))


def test_a_trainer_step_counts_the_states_it_downloaded() -> None:
    """``CollabTrainerStep.state_downloads``: the synced optimizer's successful resyncs (a download replaced
    the trainer's weights: what it published before is no longer what it keeps); 0 for a plain optimizer."""
    from echo_p2p.collab.optimizer import CollabTrainerStep

    synced = SimpleNamespace(sync_stats={"resyncs": 2, "resync_failures": 5})
    assert CollabTrainerStep(learner=None, optimizer=synced).state_downloads == 2
    assert CollabTrainerStep(learner=None, optimizer=SimpleNamespace()).state_downloads == 0


def test_hivemind_averages_a_part_whose_only_remaining_sender_has_weight_0_to_nan() -> None:
    """Why ``SyncedOptimizer`` checks a round's average: hivemind 1.1.12's reducer divides a part by the sum of
    its senders' weights, so a part sent only by a member that joined with weight 0 (an idle trainer) while
    the other member failed comes out 0/0. This plays it on hivemind's own ``TensorPartReducer``."""
    import asyncio

    import torch
    from hivemind.averaging.partition import TensorPartReducer

    async def play() -> torch.Tensor:
        reducer = TensorPartReducer([torch.Size([3])], num_senders=2)
        idle = asyncio.create_task(reducer.accumulate_part(0, 0, torch.zeros(3), weight=0.0))
        await asyncio.sleep(0)
        reducer.on_sender_failed(1)  # the member with samples never sent its part
        return await idle

    assert torch.isnan(asyncio.run(play())).all()


class _Averager:
    """The gradient averager as ``_average_gradients_and_load_into_optimizer`` sees it: averaged buffers that a
    round filled, local accumulators it falls back to."""

    def __init__(self, averaged: list, local: list) -> None:
        self.averaged, self.local = averaged, local

    def get_tensors(self):
        import contextlib

        return contextlib.nullcontext(self.averaged)

    def load_accumulators_into_averager_(self) -> None:
        for buffer, value in zip(self.averaged, self.local, strict=True):
            buffer.copy_(value)


def test_a_round_whose_average_is_not_finite_is_never_applied() -> None:
    """The hour at 85050cd: a trainer's weights became NaN after a partial round and it reloaded a checkpoint.
    Now a round whose averaged gradients are not finite counts as failed: a trainer that stepped applies its
    own gradients and downloads the others' state, an idle one (weight 0) stays at its epoch; a finite round
    is applied as it came."""
    import threading

    import torch

    from echo_p2p.collab.sync import _NoRound

    def played(averaged: list, idle_weight: int | None):
        opt = _Fake("A", 4, "t", 2)
        opt.averaging_timeout, opt.leaving, opt.status_loglevel = 5.0, threading.Event(), 10
        opt._idle_weight = idle_weight
        opt.grad_averager = _Averager(averaged, [torch.ones(2), torch.ones(1)])
        loaded: list = []
        opt._load_averaged_gradients_into_optimizer_ = lambda: loaded.append([t.clone() for t in averaged])
        round_ = _Round()
        round_.ready.set()
        try:
            opt._average_gradients_and_load_into_optimizer(round_)
        except _NoRound:
            return opt, loaded, True
        return opt, loaded, False

    nan = [torch.tensor([0.5, float("nan")]), torch.tensor([2.0])]
    opt, loaded, abandoned = played([t.clone() for t in nan], idle_weight=None)
    assert not abandoned and opt.sync_stats["nonfinite_rounds"] == 1 and opt._round_tags is None
    assert len(loaded) == 1 and all(torch.equal(t, torch.ones_like(t)) for t in loaded[0])  # own gradients
    opt.state_averager.local_epoch += 1
    opt._after_epoch((4, "t"))
    assert opt._must_resync and not opt.in_sync  # a failed round with another trainer: download theirs

    opt, loaded, abandoned = played([t.clone() for t in nan], idle_weight=0)
    assert abandoned and not loaded and opt.sync_stats["nonfinite_rounds"] == 1

    finite = [torch.tensor([0.5, -1.0]), torch.tensor([2.0])]
    opt, loaded, abandoned = played([t.clone() for t in finite], idle_weight=0)
    assert not abandoned and opt.sync_stats["nonfinite_rounds"] == 0 and opt._round_tags == {"peer": (1, "t")}
    assert all(torch.equal(a, b) for a, b in zip(loaded[0], finite, strict=True))


def test_a_step_in_which_hivemind_loads_the_others_state_discards_its_batch() -> None:
    """hivemind's ``step`` finding the trainer out of sync loads the others' state and returns without
    accumulating the batch: ``CollabStepResult.discarded`` says so (the trainer then writes no training step
    for it; a restarted trainer's failed download once showed as a step at its checkpoint's version in
    tests/integration/test_churn.py), whether the download loaded a state or not; a step that accumulated
    or ended an epoch is no discard."""
    from echo_p2p.collab.optimizer import CollabTrainerStep

    class Optimizer:
        def __init__(self, outcome: str) -> None:
            self.outcome, self.local_epoch = outcome, 10
            self.sync_stats = dict.fromkeys(SYNC_STATS, 0)

        def step(self, batch_size: int) -> None:
            if self.outcome == "loaded":
                self.sync_stats["resyncs"] += 1
                self.local_epoch = 46
            elif self.outcome == "failed":
                self.sync_stats["resync_failures"] += 1
            elif self.outcome == "epoch":
                self.local_epoch += 1

    learner = SimpleNamespace(compute_gradients=lambda groups, **kwargs: {"loss": 0.1})
    results = {}
    for outcome in ("loaded", "failed", "epoch", "accumulated"):
        stepper = CollabTrainerStep(learner=learner, optimizer=Optimizer(outcome))
        stepper.optimizer.sync_stats["resyncs"] = 3  # downloads before the step (catch-ups) do not count
        results[outcome] = stepper([object(), object()])
    assert (
        results["loaded"].discarded and results["loaded"].version == 46 and results["loaded"].batch_size == 0
    )
    assert results["failed"].discarded and not results["failed"].advanced and results["failed"].version == 10
    assert not results["epoch"].discarded and results["epoch"].version == 11
    assert not results["accumulated"].discarded and results["accumulated"].batch_size == 2


def test_a_downloaded_state_is_loaded_only_with_the_tensors_its_metadata_names(monkeypatch) -> None:
    """``TaggedStateAverager.load_state_from_peers``: a state with fewer (or more) tensors than its metadata
    names, malformed optimizer metadata, or parameters of other shapes is refused whole (None, nothing
    loaded) instead of failing with IndexError inside hivemind's ``load_optimizer_state`` or half-loading; a
    whole one loads parameters, statistics and epoch."""
    import threading

    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.optim.state_averager import dump_optimizer_state

    from echo_p2p.collab.averagers import TaggedStateAverager, optimizer_tensors_named

    def donor_state(shape=(3,)) -> tuple[dict, list]:
        param = torch.nn.Parameter(torch.full(shape, 2.0))
        opt = torch.optim.Adam([param], lr=0.1)
        param.grad = torch.ones(shape)
        opt.step()
        meta, tensors = dump_optimizer_state(opt)
        return {"epoch": 7, "optimizer_metadata": meta}, [param.detach().clone(), *tensors]

    def ours() -> TaggedStateAverager:
        avg = object.__new__(TaggedStateAverager)  # no averager process: only the loading logic
        param = torch.nn.Parameter(torch.zeros(3))
        avg._parent_pid = None  # hivemind's ``__del__`` stops the averager's process when it is its parent
        avg.optimizer = torch.optim.Adam([param], lr=0.1)
        param.grad = torch.zeros(3)
        avg.optimizer.step()  # statistics exist (hivemind initialises them): a zero step leaves param at 0
        avg.extra_tensors, avg.local_epoch, avg.lock_averaged_tensors = (), 5, threading.Lock()
        avg.offload_optimizer, avg.reuse_tensors, avg._update_scheduler = False, True, lambda: None
        return avg

    def load(state: tuple[dict, list]) -> tuple[TaggedStateAverager, dict | None]:
        monkeypatch.setattr(DecentralizedAverager, "load_state_from_peers", lambda self, **kw: state)
        avg = ours()
        return avg, avg.load_state_from_peers(timeout=1)

    meta, tensors = donor_state()
    assert optimizer_tensors_named(meta["optimizer_metadata"]) == len(tensors) - 1
    assert (
        optimizer_tensors_named("x") is None
        and optimizer_tensors_named([{"type": "tensor", "index": 3}]) is None
    )
    for bad in ((meta, tensors[:-1]), (meta, [*tensors, torch.zeros(1)]),
                ({**meta, "optimizer_metadata": [{"type": "tensor", "index": 99}]}, tensors),
                donor_state(shape=(4,))):  # fmt: skip
        avg, loaded = load(bad)
        assert loaded is None and avg.local_epoch == 5, bad[0]
        state = next(iter(avg.optimizer.state.values()))
        assert (avg.optimizer.param_groups[0]["params"][0] == 0).all() and (state["exp_avg"] == 0).all()
    avg, loaded = load((meta, tensors))
    assert loaded is not None and avg.local_epoch == 7
    state = next(iter(avg.optimizer.state.values()))
    assert (avg.optimizer.param_groups[0]["params"][0] == tensors[0]).all() and (state["exp_avg"] > 0).all()
