"""Every setting does something: a documented setting that nothing reads fails here.

Three checks, from the strongest to the broadest:

- the trainer's training settings, dynamically: every ``trainer.optimizer`` field set to a non-default value
  reaches the AdamW inside a trainer peer's ``hivemind.Optimizer`` and the co-located loop's AdamW; every
  ``GRPOConfig`` field is read by the ``Learner`` during a step; every ``CollabOptimizerConfig`` field is
  read by ``make_collab_optimizer``; every run or trainer setting a trainer derives its loss settings from
  changes them (``roles.trainer.peer.trainer_derived_settings``);
- every field of every config model of a peer (``PeerConfig``, recursively), of the co-located loop and of
  a bootstrap, statically: its name is read as an attribute (or named in a ``getattr`` / ``model_dump``
  string) somewhere in ``echo_p2p`` outside the class that defines it. That cannot tell two readers apart
  (a field called ``enabled`` is "read" by any ``.enabled``), but a setting nobody reads at all fails;
- a setting named in the README or ``docs/`` as a dotted ``section.field`` exists.

A setting that is only handed on whole (a ``model_dump``, a ``**`` call) goes in ``HANDED_ON`` with where.
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from echo_p2p.colocated import ColocatedConfig
from echo_p2p.config import BootstrapConfig, PeerConfig
from echo_p2p.train.config import GRPOConfig, OptimizerConfig

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "echo_p2p"

#: Fields read only as a whole model (never ``.name``), and where: the static check accepts them.
HANDED_ON: dict[str, str] = {}

#: A non-default value per OptimizerConfig field and the AdamW param-group key it must reach.
OPTIMIZER_VALUES = {"lr": (3e-4, "lr"), "betas": ((0.8, 0.95), "betas"), "eps": (1e-6, "eps"),
                    "weight_decay": (0.01, "weight_decay")}  # fmt: skip


class Reads:
    """Wraps a config object and records every attribute read from it."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._target, name)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for t in (annotation, *typing.get_args(annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def _models(root: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[type[BaseModel]]:
    seen = set() if seen is None else seen
    if root not in seen:
        seen.add(root)
        for field in root.model_fields.values():
            sub = _model_of(field.annotation)
            if sub is not None:
                _models(sub, seen)
    return seen


def test_the_optimizer_setting_reaches_the_adamw_of_trainer_peers_and_of_the_colocated_loop(monkeypatch):
    from echo_p2p.collab import optimizer as collab
    from echo_p2p.collab import sync
    from echo_p2p.collab.optimizer import make_collab_optimizer

    assert set(OPTIMIZER_VALUES) == set(OptimizerConfig.model_fields), "a new optimizer field: add a value"
    captured: dict[str, Any] = {}
    monkeypatch.setattr(sync, "SyncedOptimizer", lambda **kwargs: captured.update(kwargs))
    params = [torch.nn.Parameter(torch.zeros(2))]
    base = {"role": "trainer", "run_id": "r", "network": {"initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/QmX"]}}
    for name, (value, key) in OPTIMIZER_VALUES.items():
        assert getattr(OptimizerConfig(), name) != value
        config = PeerConfig.model_validate({**base, "trainer": {"optimizer": {name: value}}})
        make_collab_optimizer(None, "r", params, config.trainer.collab, config.trainer.optimizer)
        adamw = captured["optimizer"](params)  # what hivemind.Optimizer builds its AdamW with
        assert adamw.param_groups[0][key] == value, name
        colocated = ColocatedConfig(optimizer={name: value})
        # the co-located loop builds its AdamW the same way (ColocatedTrainer: config.optimizer.adamw)
        assert colocated.optimizer.adamw(params).param_groups[0][key] == value, name
    assert collab.make_collab_optimizer is make_collab_optimizer
    source = (PACKAGE / "colocated.py").read_text()
    assert "config.optimizer.adamw(self.model.parameters())" in source


def test_every_collab_setting_is_read_by_make_collab_optimizer(monkeypatch):
    from echo_p2p.collab import sync
    from echo_p2p.collab.optimizer import CollabOptimizerConfig, make_collab_optimizer

    monkeypatch.setattr(sync, "SyncedOptimizer", lambda **kwargs: kwargs)
    config = Reads(CollabOptimizerConfig())
    make_collab_optimizer(None, "r", [torch.nn.Parameter(torch.zeros(2))], config, OptimizerConfig())
    assert set(CollabOptimizerConfig.model_fields) - config.read == set()


def test_every_grpo_setting_is_read_by_the_learner_in_a_step(tiny_model, random_groups):
    from echo_p2p.train.learner import Learner

    model = tiny_model()
    for objective in ("decoupled", "ppo"):
        config = Reads(GRPOConfig(objective=objective))
        learner = Learner(model, config)  # type: ignore[arg-type]
        optimizer = OptimizerConfig().adamw(model.parameters())
        learner.step(random_groups(seed=1), optimizer, current_version=2)
        learner.measure_drift()
        if objective == "decoupled":
            decoupled = set(config.read)
    unread = set(GRPOConfig.model_fields) - decoupled - config.read
    assert unread == set(), f"GRPOConfig fields no step reads: {unread}"


@pytest.mark.parametrize(
    ("dotted", "value", "derived"),
    [
        ("run.temperature", 0.7, "temperature"),
        ("run.top_k", 20, "top_k"),
        ("run.top_p", 0.9, "top_p"),
        ("trainer.encoding.serving_dtype", "fp16", "policy_precision"),
        ("trainer.encoding.encoding", "fp32", "policy_precision"),
        ("trainer.reputation.exclude_logprob_gap", 7.5, "max_logprob_gap"),
    ],
)
def test_each_setting_a_trainer_derives_its_loss_settings_from_changes_them(dotted, value, derived):
    from echo_p2p.config import set_dotted
    from echo_p2p.roles.trainer.peer import trainer_derived_settings

    class Tokenizer:
        pad_token_id = 3

    data: dict[str, Any] = {"role": "trainer", "run_id": "r"}
    set_dotted(data, "network.initial_peers", ["/ip4/127.0.0.1/tcp/1/p2p/QmX"])
    default = trainer_derived_settings(PeerConfig.model_validate(data), Tokenizer())
    set_dotted(data, dotted, value)
    changed = trainer_derived_settings(PeerConfig.model_validate(data), Tokenizer())
    assert getattr(changed, derived) != getattr(default, derived), dotted
    assert default.pad_token_id == 3  # the tokenizer's


def _read_names() -> set[str]:
    """Attribute names read anywhere in the package, and string constants (getattr, dotted paths)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return names


def test_every_field_of_every_config_model_is_read_somewhere():
    read = _read_names()
    unread = []
    for model in sorted(_models(PeerConfig) | _models(ColocatedConfig) | _models(BootstrapConfig), key=str):
        for name in model.model_fields:
            if name not in read and f"{model.__name__}.{name}" not in HANDED_ON:
                unread.append(f"{model.__module__}.{model.__name__}.{name}")
    assert unread == [], f"settings nothing reads: {unread}"


def _peer_settings() -> set[str]:
    out: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            out.add(prefix + name)
            sub = _model_of(field.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(PeerConfig, "")
    return out


def test_the_settings_the_docs_name_exist():
    """A dotted setting in backticks (`trainer.grpo.kl_beta`) in the README or docs/ is a PeerConfig field."""
    settings = _peer_settings()
    sections = {s.split(".")[0] for s in settings if "." in s}
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for dotted in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`", doc.read_text()):
            if dotted.split(".")[0] in sections and dotted not in settings:
                missing.append(f"{doc.name}: {dotted}")
    assert missing == [], f"documented settings that do not exist: {missing}"
