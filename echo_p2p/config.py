"""Configuration objects of every CLI and peer, and how they are built from YAML, environment and flags.

Owned here: the pydantic config classes (a docstring on every field), the precedence rule
(defaults < YAML file < ``ECHO_*`` environment variables < command-line flags) and the error that names the
offending field. Callers: the CLI modules (``peer``, ``bootstrap``, ``swarm``, ``local``), which must turn a
``ConfigError`` into a clear message and exit code 2 before any network start. This module must stay cheap
to import: no torch, no hivemind.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from echo_p2p.collab.optimizer import CollabOptimizerConfig
from echo_p2p.guard.reputation import ReputationConfig
from echo_p2p.guard.sampling_check import SamplingCheckConfig
from echo_p2p.ml.engine import SamplingParams
from echo_p2p.ml.engine_vllm import VllmEngineConfig
from echo_p2p.ml.models import PRESET_TRAINER_DEFAULTS, ModelSpec
from echo_p2p.net.keys import validate_run_id
from echo_p2p.net.network_config import NetworkConfig
from echo_p2p.net.records import MAX_RECORD_TTL
from echo_p2p.paths import UserPath, expand_path
from echo_p2p.roles.watchdog import WatchdogConfig
from echo_p2p.train.config import GRPOConfig, OptimizerConfig
from echo_p2p.train.evaluation import EvalConfig
from echo_p2p.train.pacing import PacingConfig
from echo_p2p.train.trackers import ReportConfig
from echo_p2p.transport.rollouts.config import (
    IngestServerConfig,
    PusherConfig,
    SampleClientConfig,
    SampleServerConfig,
)
from echo_p2p.weights.config import EncodingConfig

PUBLIC_BOOTSTRAP_PORT = 31337


class ConfigError(ValueError):
    """Invalid configuration: the message names the field and what is wrong with it."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSettings(StrictModel):
    """What every peer of a run must agree on: the policy, the task, the group size, how to sample."""

    model: ModelSpec = Field(
        default_factory=lambda: ModelSpec(preset="tiny"), description="The policy (default: the tiny preset)"
    )
    task: str = Field(default="count", description="Task name (count, letter, arithmetic, sokoban, plugin)")
    task_options: dict[str, Any] = Field(default_factory=dict, description="Options of the task")
    group_size: int = Field(default=16, ge=2, le=1024, description="G: completions sampled per prompt")
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature; the trainer's importance ratio uses the same"
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off)")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0 = off)")
    sampler_precisions: list[Literal["float32", "bfloat16", "float16", "8bit", "4bit"]] | None = Field(
        default=None,
        description="Weight precisions of inference peers whose rollouts trainers accept (None: any); an "
        "inference peer of another precision does not start",
    )
    max_new_tokens: int | None = Field(
        default=None, ge=1, description="Completion length cap; None: the task's own cap"
    )
    seeded_sampling: bool = Field(
        default=True,
        description="Every group is drawn from a seed it carries (``ml.seeded``) and trainers replay the draws "
        "they check, so an edited completion is caught at its first group; trainers refuse unseeded groups. "
        "False admits samplers that cannot draw from a seed (the vLLM engine): edits are then caught only by "
        "statistics (docs/security.md)",
    )

    @model_validator(mode="after")
    def _task(self) -> RunSettings:
        """Unknown tasks and bad task options fail here, before any network start."""
        from echo_p2p.tasks.base import TaskError
        from echo_p2p.tasks.registry import task_options_model

        try:
            task_options_model(self.task).model_validate(self.task_options)
        except TaskError as exc:
            raise ValueError(str(exc)) from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"bad task_options for task {self.task!r}: {problems}") from None
        return self

    def sampling(self, engine: str = "", precision: str = ""):
        """What a rollout group says about how it was sampled (``rollout.Sampling``); trainers require
        temperature, top_p and top_k to equal the run's."""
        from echo_p2p.rollout import Sampling

        return Sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            engine=engine,
            precision=precision,
        )

    def sampler_precision(self) -> str:
        """This peer's weight precision as rollouts report it: its quantisation, else its dtype."""
        return self.model.quantize or self.model.dtype

    def sampling_params(self, task_max_new_tokens: int, seed: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens or task_max_new_tokens,
            seed=seed,
        )


class InferenceSection(StrictModel):
    """Settings of an inference peer."""

    engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description="Sampling engine (vllm: in its own environment, scripts/setup_vllm.sh)",
    )
    vllm: VllmEngineConfig = Field(
        default_factory=VllmEngineConfig, description="Settings of the vLLM engine (engine: vllm)"
    )
    prompts_per_batch: int = Field(default=16, ge=1, le=4096, description="Prompts sampled together (async)")
    first_version_timeout: float = Field(
        default=600.0, gt=0, description="Seconds to wait for the first policy version before giving up"
    )
    serve_weights: bool = Field(
        default=True, description="Serve the policy chunks this peer holds to other peers (peer assistance)"
    )
    weights_poll_period: float = Field(
        default=1.0,
        gt=0,
        le=600,
        description="Async: seconds between two checks for a newer policy version (a trainer's ack reporting "
        "a newer version triggers a check at once)",
    )
    stale_wait: float = Field(
        default=2.0,
        ge=0,
        le=600,
        description="Async: when trainers refuse this peer's version as too stale, wait up to this long for "
        "a newer version before sampling again",
    )
    pusher: PusherConfig = Field(default_factory=PusherConfig, description="Async mode: pushing rollouts")
    sample_server: SampleServerConfig = Field(
        default_factory=SampleServerConfig, description="Sync mode: limits of the sample RPC"
    )


class TrainerSection(StrictModel):
    """Settings of a trainer peer."""

    reputation: ReputationConfig = Field(
        default_factory=ReputationConfig,
        description="How the trainer checks senders' behaviour log-probs and bans liars (docs/security.md)",
    )
    sampling_check: SamplingCheckConfig = Field(
        default_factory=SamplingCheckConfig,
        description="How the trainer tests that senders' completions are samples of the policy, leaves the "
        "unlikely ones out of the loss and strikes their senders (docs/security.md)",
    )
    prompts_per_step: int = Field(default=16, ge=1, le=4096, description="Rollout groups per GRPO step")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO loss and micro-batching")
    optimizer: OptimizerConfig = Field(
        default_factory=OptimizerConfig,
        description="AdamW (lr, betas, eps, weight decay) of every update; the co-located loop's is the same "
        "setting (a model preset may set lr: smollm2's 1e-6)",
    )
    collab: CollabOptimizerConfig = Field(
        default_factory=CollabOptimizerConfig,
        description="hivemind.Optimizer across trainers (target batch in groups, matchmaking, deadlines)",
    )

    max_staleness: int = Field(
        default=4, ge=0, le=64, description="Async: drop rollouts more than this many versions old"
    )
    buffer_order: Literal["oldest", "newest"] = Field(
        default="oldest",
        description="Async: which usable rollouts a step takes first; oldest = every group before it "
        "expires (paced samplers keep about two batches buffered); newest = least stale, for samplers that "
        "produce far more than the trainer consumes (what gets too old is dropped)",
    )
    pacing: PacingConfig = Field(
        default_factory=PacingConfig,
        description="Async: grant inference peers only what will be trained on within max_staleness",
    )
    buffer_capacity: int | None = Field(
        default=None,
        ge=1,
        description="Replay buffer size in groups (None: from batch, staleness and the inference peers that "
        "pushed to this trainer recently)",
    )
    reward_tolerance: float = Field(
        default=1e-3,
        ge=0,
        allow_inf_nan=False,
        description="Claimed-vs-rescored reward gap not counted as forged, relative: accepted when "
        "|claimed - rescored| <= reward_tolerance * max(1, |rescored|) (rewards may have any scale)",
    )
    max_prompt_tokens: int = Field(default=1024, ge=1, description="Longest prompt accepted (tokens)")
    encoding: EncodingConfig = Field(
        default_factory=lambda: EncodingConfig(keyframe_interval=10), description="How versions are published"
    )
    checkpoint_dir: UserPath | None = Field(default=None, description="Write checkpoints here (None: none)")
    checkpoint_every: int = Field(default=10, ge=1, description="Versions between two checkpoints")
    keep_checkpoints: int = Field(
        default=2, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted"
    )
    journal: bool = Field(
        default=True,
        description="Async: keep every acknowledged rollout group in checkpoint_dir/intake.journal until it "
        "is used, and buffer the unused ones again on --resume (a killed trainer loses none it acknowledged)",
    )
    publish_interval: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Async: fewest seconds between two published versions (0: every version); the versions "
        "in between are not published, so inference peers fetch less often and staleness counts more versions",
    )
    resume: bool = Field(default=False, description="Continue from the newest checkpoint in checkpoint_dir")
    report: ReportConfig = Field(default_factory=ReportConfig, description="TensorBoard / wandb figures")
    evaluation: EvalConfig = Field(
        default_factory=EvalConfig,
        description="The publisher scores versions on the task's held-out prompts (every 5 s by default, at "
        "most 5% of the time)",
    )
    sync_timeout: float = Field(default=60.0, gt=0, description="Sync: deadline (s) to collect one batch")
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many versions (None: never)"
    )
    ingest_server: IngestServerConfig = Field(
        default_factory=IngestServerConfig, description="Async mode: limits of the ingest RPC"
    )
    sample_client: SampleClientConfig = Field(
        default_factory=SampleClientConfig, description="Sync mode: asking inference peers"
    )


class PeerConfig(StrictModel):
    """A peer of a run (``python -m echo_p2p.peer``)."""

    role: Literal["inference", "trainer"] = Field(description="What this peer does in the run")
    run_id: str = Field(description="Name of the run to join (1-64 chars of A-Za-z0-9_-)")
    mode: Literal["sync", "async"] = Field(
        default="async",
        description="sync: sequential pull (on-policy); async: push-pull with bounded staleness",
    )
    network: NetworkConfig = Field(
        default_factory=NetworkConfig, description="Addresses, identity, deadlines"
    )
    metrics_dir: UserPath | None = Field(
        default=None, description="Append metrics as JSON lines to <dir>/<role>-<peer id>.jsonl"
    )
    metrics_period: float = Field(
        default=10.0, gt=0, le=3600, description="Seconds between two metrics lines"
    )
    heartbeat_period: float = Field(
        default=5.0, ge=0.2, le=200, description="Seconds between two announcements"
    )
    record_ttl: float | None = Field(
        default=None,
        gt=0,
        le=MAX_RECORD_TTL,
        description="Lifetime (s) of an announcement; default 3 heartbeats",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level")
    run_owner: str | None = Field(
        default=None,
        max_length=128,
        description="Peer id of the run owner's key (the OWNER of a --join address): this peer trusts the "
        "trainers of the newest valid run record that key signed (docs/trust.md)",
    )
    run_record_serial: int = Field(
        default=0,
        ge=0,
        le=2**63 - 1,
        description="Refuse run records with a lower serial (the #SERIAL of a --join address): an eclipse "
        "serving only an older record cannot roll the trusted trainers back",
    )
    run_record: UserPath | None = Field(
        default=None,
        description="A signed run record file (python -m echo_p2p.owner sign): this peer keeps it on the DHT "
        "and trusts its trainers (given to the trainers; a bootstrap takes one too)",
    )
    trusted_trainers: UserPath | None = Field(
        default=None,
        description="For runs without an owner (run_owner / run_record): the file of the run's trainers' "
        "public keys / peer ids (docs/trust.md). An inference peer accepts weights from and pushes rollouts "
        "to these only (it needs one of the three); trainers elect the publisher among them (unset: any "
        "peer announcing itself a trainer takes part)",
    )
    threads: int | None = Field(default=None, ge=1, description="torch CPU threads (None: torch's default)")
    seed: int | None = Field(
        default=None,
        description="Seed of the prompts this peer picks (an inference peer: and of its sampling); None: random",
    )
    run: RunSettings = Field(default_factory=RunSettings, description="What all peers of the run agree on")
    inference: InferenceSection = Field(
        default_factory=InferenceSection, description="Inference peer settings"
    )
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="Trainer peer settings")
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig,
        description="Progress signals with deadlines; what a stalled peer does (docs/reliability.md)",
    )

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_run_id(value)

    @model_validator(mode="before")
    @classmethod
    def _preset_defaults_in_data(cls, data: Any) -> Any:
        """The model preset's trainer settings go under what the given mapping leaves unset (the classes'
        defaults fill the rest)."""
        if not isinstance(data, Mapping):
            return data
        run = data.get("run")
        model = run.get("model") if isinstance(run, Mapping) else getattr(run, "model", None)
        preset = model.get("preset") if isinstance(model, Mapping) else getattr(model, "preset", None)
        if run is None or model is None:
            preset = "tiny"  # RunSettings' default model
        data = copy.deepcopy(dict(data))
        for dotted, value in PRESET_TRAINER_DEFAULTS.get(preset or "", {}).items():
            *parents, last = dotted.split(".")
            node: Any = data
            for name in parents:
                child = node.get(name) if isinstance(node, Mapping) else None
                if child is None and isinstance(node, dict):
                    child = node[name] = {}
                node = child
            if isinstance(node, dict) and last not in node:
                node[last] = value
        return data

    @model_validator(mode="after")
    def _preset_defaults(self) -> PeerConfig:
        """The model preset's trainer settings (``PRESET_TRAINER_DEFAULTS``, e.g. SmolLM2's lr 1e-6) replace
        the defaults of the fields that the given data leaves unset; a field given anywhere always wins."""
        for dotted, value in PRESET_TRAINER_DEFAULTS.get(self.run.model.preset or "", {}).items():
            *parents, last = dotted.split(".")
            node: BaseModel = self
            given = True
            for name in parents:
                given = given and name in node.model_fields_set
                node = getattr(node, name)
            if not (given and last in node.model_fields_set):
                object.__setattr__(node, last, value)
        return self

    @model_validator(mode="after")
    def _ttl(self) -> PeerConfig:
        if not self.network.initial_peers:
            raise ValueError(
                "network.initial_peers is empty: pass --initial-peers with the multiaddr a bootstrap printed"
            )
        owned = self.run_owner is not None or self.run_record is not None
        if self.role == "inference" and not self.trusted_trainers and not owned:
            raise ValueError(
                "no trusted trainers: an inference peer accepts policy weights only from the run's trainers; "
                "join with --join RUN:OWNER@MADDRS, or pass --trusted-trainers FILE (see docs/trust.md)"
            )
        if owned and self.trusted_trainers:
            raise ValueError(
                "give either a run owner (--join / --run-record) or --trusted-trainers, not both: the run "
                "record lists the trainers"
            )
        if self.watchdog.enabled and self.watchdog.dht_deadline < 2 * self.heartbeat_period:
            raise ValueError(
                f"watchdog.dht_deadline ({self.watchdog.dht_deadline}) must be at least two heartbeats "
                f"({2 * self.heartbeat_period}): the record is stored once a heartbeat"
            )
        if self.record_ttl is None:
            object.__setattr__(self, "record_ttl", 3 * self.heartbeat_period)
        elif self.record_ttl <= self.heartbeat_period:
            raise ValueError(
                f"record_ttl ({self.record_ttl}) must exceed heartbeat_period ({self.heartbeat_period})"
            )
        return self


class BootstrapConfig(StrictModel):
    """A bootstrap peer (``python -m echo_p2p.bootstrap``): a long-lived DHT node that newcomers dial first."""

    network: NetworkConfig = Field(
        default_factory=lambda: NetworkConfig(
            host_maddrs=[f"/ip4/0.0.0.0/tcp/{PUBLIC_BOOTSTRAP_PORT}"], reachability="public"
        ),
        description="Listening addresses (default: all interfaces, TCP 31337), identity, other bootstraps; "
        "reachable by definition (reachability public: it relays for peers behind NAT from the start)",
    )
    maddrs_file: UserPath | None = Field(
        default=None, description="Write the visible multiaddrs here, one per line"
    )
    run_record: UserPath | None = Field(
        default=None,
        description="A signed run record file (python -m echo_p2p.owner sign) to keep on the DHT: peers that "
        "join with the run owner's address find the run's trainers through it",
    )
    run_ids: list[str] = Field(
        default_factory=list, description="Runs whose records this node also schema-validates (optional)"
    )
    status_period: float = Field(default=30.0, gt=0, le=3600, description="Seconds between two status lines")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level")

    @field_validator("run_ids")
    @classmethod
    def _run_ids(cls, value: list[str]) -> list[str]:
        return [validate_run_id(v) for v in value]


#: ECHO_* environment variables users expect, and the config field each one sets.
ENV_VARS: dict[str, str] = {
    "ECHO_RUN_ID": "run_id",
    "ECHO_ROLE": "role",
    "ECHO_MODE": "mode",
    "ECHO_METRICS_DIR": "metrics_dir",
    "ECHO_LOG_LEVEL": "log_level",
    "ECHO_INITIAL_PEERS": "network.initial_peers",
    "ECHO_HOST_MADDRS": "network.host_maddrs",
    "ECHO_ANNOUNCE_MADDRS": "network.announce_maddrs",
    "ECHO_IDENTITY_PATH": "network.identity_path",
    "ECHO_TRUSTED_TRAINERS": "trusted_trainers",
}
#: The subset that makes sense for a bootstrap peer.
BOOTSTRAP_ENV_VARS: dict[str, str] = {
    k: v for k, v in ENV_VARS.items() if v.startswith("network.") or v == "log_level"
}
LIST_FIELDS = {"network.initial_peers", "network.host_maddrs", "network.announce_maddrs"}


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML config file into a dict; ConfigError when unreadable or not a mapping."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of fields, not {type(data).__name__}")
    return data


def set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``target['a']['b'] = value`` for ``dotted='a.b'``, creating sub-dicts."""
    *parents, last = dotted.split(".")
    node = target
    for name in parents:
        child = node.get(name)
        if not isinstance(child, dict):
            child = {}
            node[name] = child
        node = child
    node[last] = value


def env_overrides(environ: Mapping[str, str], fields: Mapping[str, str] = ENV_VARS) -> dict[str, Any]:
    """The ``ECHO_*`` variables that are set, as dotted field -> value (lists split on commas/spaces)."""
    out: dict[str, Any] = {}
    for var, dotted in fields.items():
        raw = environ.get(var)
        if raw is None or raw == "":
            continue
        out[dotted] = raw.replace(",", " ").split() if dotted in LIST_FIELDS else raw
    return out


def build_config(
    cls: type[BaseModel],
    *,
    yaml_path: str | None = None,
    environ: Mapping[str, str] | None = None,
    env_fields: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Any:
    """Merge defaults < YAML < environment < flags (dotted names -> values; None = not given) and validate."""
    data: dict[str, Any] = load_yaml(expand_path(yaml_path)) if yaml_path else {}
    if environ is not None:
        for dotted, value in env_overrides(environ, env_fields or ENV_VARS).items():
            set_dotted(data, dotted, value)
    for dotted, value in (flags or {}).items():
        if value is not None:
            set_dotted(data, dotted, value)
    model = data.get("run", {}).get("model") if isinstance(data.get("run"), dict) else None
    if isinstance(model, dict) and not {"preset", "path", "gguf_file"} & model.keys():
        model["preset"] = "tiny"  # e.g. only --quantize given: the default model, quantised
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from exc


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each naming the dotted config field."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(config)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"config field '{loc}': {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)
