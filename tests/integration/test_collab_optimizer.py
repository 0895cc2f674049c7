"""Trainers aggregate with hivemind.Optimizer: same epoch and parameters; a late trainer catches up.

Three real trainer processes (``collab_trainer.py``) on 127.0.0.1, each in its own process group: A
bootstraps the DHT, B joins it; both train the same tiny policy on different data (their own samples of
``count``) until epoch ``EPOCHS`` and an epoch agreed with the other (one more when the last round failed
for both), then hold; B has no batch from epoch ``EPOCHS - 2`` on and reaches the last epochs by joining A's
rounds, which never wait for it. C joins late, loads the swarm's state and must hold exactly
the epoch and parameters of the trainer furthest ahead without having trained them itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from echo_p2p import PROTOCOL_VERSION
from tests.conftest import REPO, Procs, read_log, wait_until

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow(55)]

SCRIPT = str(REPO / "tests" / "integration" / "collab_trainer.py")
EPOCHS = 4


def _load(result: Path) -> tuple[dict, dict]:
    info = json.loads(result.read_text())
    return info, torch.load(result.with_name(result.name + ".pt"), weights_only=True)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _wait_file(path: Path, procs_alive: list, timeout: float, what: str) -> None:
    def ready() -> bool:
        for proc in procs_alive:
            assert proc.poll() is None, f"{what}: a trainer exited early:\n{read_log(proc)[-3000:]}"
        return path.exists() and path.stat().st_size > 0

    wait_until(ready, timeout, period=0.1, what=what)


def test_two_trainers_share_epochs_and_parameters_and_a_late_one_catches_up(
    procs: Procs, tmp_path: Path
) -> None:
    start, done = tmp_path / "start", tmp_path / "done"
    common = [
        SCRIPT,
        "--run-id",
        "collab-test",
        "--until-epoch",
        str(EPOCHS),
        "--prompts-per-step",
        "4",
        "--target-batch-size",
        "16",  # two trainers: ~2 local steps each per epoch
        "--step-pause",
        "0.2",  # paces a step like a real one, so an epoch is longer than a progress refresh
        "--start-file",
        str(start),
        "--hold-file",
        str(done),
        "--hold-seconds",
        "120",
        "--max-seconds",
        "60",
        "--verbose",  # hivemind's round outcomes in the logs, for the post-mortem of a failure
    ]
    a_maddrs, b_maddrs = tmp_path / "a.maddrs", tmp_path / "b.maddrs"
    a_res, b_res, c_res = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a_ready, b_ready = tmp_path / "a.ready", tmp_path / "b.ready"
    a = procs.start(
        *common, "--data-seed", "1", "--maddrs-file", str(a_maddrs), "--ready-file", str(a_ready),
        "--result", str(a_res), name="a",
    )  # fmt: skip
    _wait_file(a_maddrs, [a], 60, "trainer A's DHT")
    maddr = a_maddrs.read_text().split()[0]
    assert "/ip4/127.0.0.1/" in maddr
    b = procs.start(
        *common, "--data-seed", "2", "--initial-peer", maddr, "--maddrs-file", str(b_maddrs),
        "--idle-from-epoch", str(EPOCHS - 2),  # then B has no batch: it only joins A's rounds
        "--ready-file", str(b_ready), "--result", str(b_res), name="b",
    )  # fmt: skip
    # C starts now (its imports take seconds on a busy machine) but joins the swarm only later.
    join_c = tmp_path / "c.join"
    c = procs.start(
        *common, "--data-seed", "3", "--initial-peer", maddr, "--join-file", str(join_c),
        "--result", str(c_res), name="c",
    )  # fmt: skip
    _wait_file(a_ready, [a, b, c], 60, "trainer A's optimizer")
    _wait_file(b_ready, [a, b, c], 60, "trainer B's optimizer")
    start.touch()  # A and B are up: train

    _wait_file(a_res, [a, b, c], 60, "trainer A's result")
    _wait_file(b_res, [a, b, c], 60, "trainer B's result")
    a_info, a_state = _load(a_res)
    b_info, b_state = _load(b_res)
    # Each stops at EPOCHS once its last epoch was agreed with the other (a failed last round is repaired
    # by a state download or one more shared epoch): then both hold the same epoch and parameters.
    # One exception: a round whose averages reached one member only in part (hivemind keeps that member's own
    # values for the missing parts) is agreed for the other, which stops, while the partial member takes a
    # lineage of its own and waits for the next shared round (``SyncedOptimizer._after_epoch``); with its
    # partner gone it trains on alone. Then the two are compared where both last agreed, one epoch earlier.
    if a_info["epoch"] == b_info["epoch"]:
        epoch = a_info["epoch"]
        assert a_state["epoch"] == b_state["epoch"] == epoch
        assert EPOCHS <= epoch <= EPOCHS + 1, (a_info["sync"], b_info["sync"])
        same_a, same_b = a_state["state"], b_state["state"]
        for info in (a_info, b_info):  # the last epoch was reached together
            assert [s for s in info["steps"] if s["after"] > s["before"]][-1]["peers"] == 2, info["steps"]
    else:
        ahead = max((a_info, b_info), key=lambda info: info["epoch"])
        assert ahead["sync"]["partial"] >= 1, ("trainers stopped at different epochs", a_info, b_info)
        common = set(a_info["agreed_epochs"]) & set(b_info["agreed_epochs"])
        assert common and max(common) >= EPOCHS - 1, (a_info["agreed_epochs"], b_info["agreed_epochs"])
        same_a, same_b = a_state["agreed"][max(common)], b_state["agreed"][max(common)]
    diff = _max_diff(same_a, same_b)
    assert diff <= 1e-5, f"parameters differ by {diff}; sync A {a_info['sync']}, B {b_info['sync']}"
    # Both really trained (different data each), and an agreed epoch was reached together with 2 peers.
    for info in (a_info, b_info):
        assert len(info["steps"]) >= 2
        assert info["sync"]["agreed"] >= 1
        assert any(s["peers"] == 2 and s["after"] > s["before"] for s in info["steps"]), info["steps"]
    assert _max_diff(a_state["state"], _initial_state()) > 1e-4  # the policy moved
    # B went idle at EPOCHS - 2: it reached the later epochs in A's rounds (weight 0, the same update), and A
    # never waited a round out for it (a round that finds no group ends at averaging_timeout, 10 s)
    assert b_info["sync"]["idle_rounds"] >= 1 and any(
        s.get("idle") and not s["caught_up"] for s in b_info["steps"]
    ), b_info["steps"]
    late = [s for s in a_info["steps"] if s["before"] >= EPOCHS - 2 and s["after"] > s["before"]]
    assert late and max(s["optimizer_s"] for s in late) < 5, a_info["steps"]

    # C joins late: it must load the others' state, not train the epochs itself.
    join_c.touch()
    _wait_file(c_res, [a, b, c], 60, "late trainer C's result")
    c_info, c_state = _load(c_res)
    # it loads from the trainer furthest ahead (hivemind's state-sharing priority is the epoch)
    lead_info, lead_state = max(((a_info, a_state), (b_info, b_state)), key=lambda pair: pair[0]["epoch"])
    epoch = lead_info["epoch"]
    assert c_info["epoch"] == epoch and c_state["epoch"] == epoch
    jumps = [(s["before"], s["after"]) for s in c_info["steps"] if s["after"] > s["before"]]
    assert jumps and jumps[0] == (0, epoch), f"C did not catch up by loading state: {jumps}"
    diff_c = _max_diff(lead_state["state"], c_state["state"])
    assert diff_c <= 1e-6, f"late trainer's parameters differ by {diff_c}"

    done.touch()
    for proc in (a, b, c):
        wait_until(lambda p=proc: p.poll() is not None, 30, what="trainer shutdown")
        assert proc.returncode == 0, read_log(proc)[-3000:]


def _initial_state() -> dict[str, torch.Tensor]:
    from echo_p2p.ml.models import build_tiny_policy

    model, _ = build_tiny_policy(0)
    return model.state_dict()


def test_lone_trainer_step_advances_versions_signs_progress_and_resumes_from_a_checkpoint(
    tmp_path: Path,
) -> None:
    """In process: a lone trainer built on ``start_dht`` reaches a new version every ``target_batch_size``
    groups, and its progress record is stored (hivemind's tracker must sign with the DHT's identity key,
    otherwise the record is rejected and trainers never see each other). A trainer restarted from a
    checkpoint resumes at the saved version and goes on from there."""
    import random

    from echo_p2p.collab.optimizer import (
        CollabOptimizerConfig,
        CollabTrainerStep,
        make_collab_optimizer,
        shutdown_optimizer,
        trainer_swarm_run_id,
    )
    from echo_p2p.ml.models import build_tiny_policy
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.rollout import Completion, RolloutGroup
    from echo_p2p.train.checkpoint import CheckpointManager, CheckpointVersionError
    from echo_p2p.train.config import GRPOConfig, OptimizerConfig
    from echo_p2p.train.learner import Learner
    from echo_p2p.train.scored import ScoredGroup

    model, tokenizer = build_tiny_policy(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = random.Random(0)

    def group() -> ScoredGroup:
        comps = [
            Completion(token_ids=[rng.randrange(3, 30), 1], logprobs=[-3.0, -2.0], claimed_reward=0.0)
            for _ in range(4)
        ]
        rg = RolloutGroup(task="t", prompt_id=0, prompt_token_ids=[5, 6], completions=comps, policy_version=0)
        return ScoredGroup(rg, [0.0, 1.0, 0.0, 1.0])

    identity = load_or_create_identity(None)
    dht = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), identity, [SwarmKeys("lone")])
    opt = None
    try:
        grpo = GRPOConfig(micro_batch_size=None)
        config = CollabOptimizerConfig(target_batch_size=4)
        adamw = OptimizerConfig(lr=1e-2)
        opt = make_collab_optimizer(
            dht, "lone", model.parameters(), config, adamw, private_key=identity.private_key
        )
        assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["betas"] == adamw.betas
        step = CollabTrainerStep(Learner(model, grpo), opt)
        results = [step([group(), group()]) for _ in range(4)]
        assert [(r.version_before, r.version) for r in results] == [(0, 0), (0, 1), (1, 1), (1, 2)]
        assert [r.advanced for r in results] == [False, True, False, True]
        assert not any(r.caught_up for r in results) and results[0].batch_size == 2
        step.settle()
        assert step.version == 2
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        record = dht.get(trainer_swarm_run_id("lone") + "_progress", latest=True)
        assert record is not None and len(record.value) == 1, "progress record rejected: wrong signing key?"

        # Restart from a checkpoint: weights into a fresh model *before* the optimizer, then its state.
        ckpts = CheckpointManager(tmp_path / "ckpt")
        ckpts.save(step.version, model.state_dict(), opt.state_dict(), {"steps": len(results)})
        assert shutdown_optimizer(opt, timeout=15)
        opt = None
        saved = ckpts.load()
        model2, _ = build_tiny_policy(1)
        model2.load_state_dict(saved.model_state)
        opt = make_collab_optimizer(
            dht, "lone", model2.parameters(), config, adamw, private_key=identity.private_key
        )
        opt.load_state_dict(saved.optimizer_state)
        step2 = CollabTrainerStep(Learner(model2, grpo), opt)
        assert step2.version == 2
        resumed = []
        while step2.version < 3 and len(resumed) < 20:  # the new tracker may need a refresh or two
            resumed.append(step2([group(), group()]))
            time.sleep(0.1)
        assert [r.version for r in resumed][-1] == 3, resumed
        assert all(r.version_before >= 2 for r in resumed)  # never back below the checkpoint
        with pytest.raises(CheckpointVersionError):
            ckpts.save(1, model2.state_dict())
    finally:
        if opt is not None:
            assert shutdown_optimizer(opt, timeout=15)
        stop_dht(dht)
        identity.cleanup()


def test_config_and_run_id_rules() -> None:
    from echo_p2p.collab.optimizer import CollabOptimizerConfig, trainer_swarm_run_id

    assert trainer_swarm_run_id("demo") == f"echo-v{PROTOCOL_VERSION}-demo-trainers"
    with pytest.raises(ValueError):
        trainer_swarm_run_id("bad id/with slash")
    with pytest.raises(ValueError, match="request_timeout"):
        CollabOptimizerConfig(matchmaking_time=0.5, request_timeout=0.5)
    with pytest.raises(ValueError):
        CollabOptimizerConfig(no_such_knob=1)


def test_client_mode_of_the_config_reaches_every_averager() -> None:
    """hivemind 1.1.12 replaces an explicit ``client_mode`` by the DHT's; ``SyncedOptimizer`` honours it."""
    from echo_p2p.collab.optimizer import (
        CollabOptimizerConfig,
        make_collab_optimizer,
        shutdown_optimizer,
    )
    from echo_p2p.ml.models import build_tiny_policy
    from echo_p2p.net.identity import load_or_create_identity
    from echo_p2p.net.keys import SwarmKeys
    from echo_p2p.net.network_config import NetworkConfig
    from echo_p2p.net.node import start_dht, stop_dht
    from echo_p2p.train.config import OptimizerConfig

    identity = load_or_create_identity(None)
    dht = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), identity, [SwarmKeys("cm")])
    try:
        assert not dht.client_mode
        for wanted, expected in ((True, True), (None, False)):
            model, _ = build_tiny_policy(0)
            config = CollabOptimizerConfig(client_mode=wanted)
            opt = make_collab_optimizer(
                dht, "cm", model.parameters(), config, OptimizerConfig(), private_key=identity.private_key
            )
            try:
                parts = (opt, opt.tracker, opt.state_averager, opt.grad_averager)
                assert [bool(p.client_mode) for p in parts] == [expected] * 4, wanted
                assert opt.state_averager.allow_state_sharing is not expected
            finally:
                assert shutdown_optimizer(opt, timeout=15)
    finally:
        stop_dht(dht)
        identity.cleanup()
