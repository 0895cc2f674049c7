import subprocess
import sys
from pathlib import Path

import pytest

from echo_p2p.config import BootstrapConfig, ConfigError, PeerConfig, build_config, env_overrides

MADDR = "/ip4/127.0.0.1/tcp/4000/p2p/QmVBs4rtbHeMREzjEUBfqKvRsHfvPFy9RFAZMr9K23gFyb"
REPO = Path(__file__).resolve().parents[2]
MADDR2 = "/ip4/127.0.0.1/tcp/4001/p2p/QmVBs4rtbHeMREzjEUBfqKvRsHfvPFy9RFAZMr9K23gFyb"


def test_precedence_defaults_yaml_env_flags(tmp_path):
    cfg = tmp_path / "peer.yaml"
    cfg.write_text(
        f"role: trainer\nrun_id: from-yaml\nheartbeat_period: 2\nnetwork:\n  initial_peers: [{MADDR}]\n"
    )
    c = build_config(PeerConfig, yaml_path=str(cfg), environ={})
    assert (c.role, c.run_id, c.heartbeat_period, c.record_ttl) == ("trainer", "from-yaml", 2.0, 6.0)
    c = build_config(
        PeerConfig, yaml_path=str(cfg), environ={"ECHO_RUN_ID": "from-env", "ECHO_INITIAL_PEERS": MADDR2}
    )
    assert c.run_id == "from-env" and c.network.initial_peers == [MADDR2]
    c = build_config(
        PeerConfig, yaml_path=str(cfg), environ={"ECHO_RUN_ID": "from-env"}, flags={"run_id": "flag"}
    )
    assert c.run_id == "flag"


def test_env_lists_split_on_commas_and_spaces():
    assert env_overrides({"ECHO_INITIAL_PEERS": f"{MADDR}, {MADDR2}"}) == {
        "network.initial_peers": [MADDR, MADDR2]
    }


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"role": "wizard"}, "role"),
        ({"run_id": "bad id"}, "run_id"),
        ({"network.initial_peers": ["/ip4/1.2.3.4/tcp/5"]}, "network.initial_peers"),
        ({"network.initial_peers": ["not-a-maddr"]}, "network.initial_peers"),
        ({"network.host_maddrs": ["/ip4/999.1.1.1/tcp/1"]}, "network.host_maddrs"),
        ({"heartbeat_period": -1}, "heartbeat_period"),
        ({"record_ttl": 1.0, "heartbeat_period": 5.0}, "record_ttl"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_fields_are_named(flags, field):
    base = {"role": "trainer", "run_id": "r", "network.initial_peers": [MADDR]}
    with pytest.raises(ConfigError) as info:
        build_config(PeerConfig, environ={}, flags=base | flags)
    assert field.split(".")[-1] in str(info.value)


def test_peer_needs_initial_peers():
    with pytest.raises(ConfigError, match="initial_peers"):
        build_config(PeerConfig, environ={}, flags={"role": "trainer", "run_id": "r"})


def test_bootstrap_defaults_to_public_port_on_all_interfaces():
    c = build_config(BootstrapConfig, environ={})
    assert c.network.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]


def test_yaml_errors_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("role: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        build_config(PeerConfig, yaml_path=str(bad), environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        build_config(PeerConfig, yaml_path=str(tmp_path / "missing.yaml"), environ={})


def _run(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, env=env)


def test_cli_bad_flag_value_exits_2_naming_the_field_before_any_network_start():
    r = _run("-m", "echo_p2p.peer", "--role", "trainer", "--run-id", "bad id", "--initial-peers", MADDR)
    assert r.returncode == 2
    assert "run_id" in r.stderr and "Traceback" not in r.stderr


def test_cli_missing_initial_peers_exits_2():
    r = _run("-m", "echo_p2p.peer", "--role", "inference", "--run-id", "r")
    assert r.returncode == 2 and "initial-peers" in r.stderr


@pytest.mark.parametrize(
    "module", ["echo_p2p.peer", "echo_p2p.bootstrap", "echo_p2p.swarm", "echo_p2p.local", "echo_p2p.monitor"]
)
def test_help_is_instant_and_imports_no_torch_or_hivemind(module):
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['{module}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('{module}', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'hivemind', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    r = _run("-c", code)
    assert "usage:" in r.stdout
    assert "HEAVY []" in r.stdout, r.stdout[-500:]


@pytest.mark.parametrize("name", ["inference-gpu", "inference-cpu", "inference-vllm", "trainer"])
def test_shipped_peer_configs_are_valid(name):
    path = REPO / "peers" / f"{name}.yaml"
    owner = "QmQAbD1EUxToUawWUKjh1doo9iC83FjbPVdhye9gwMeo2v"  # what --join sets besides run id and peers
    flags = {"run_id": "r", "network.initial_peers": [MADDR], "run_owner": owner}
    c = build_config(PeerConfig, yaml_path=str(path), environ={}, flags=flags)
    assert c.role == name.split("-")[0]
    home = str(Path.home())  # their ~/.echo_p2p/... paths are expanded (the peer cache sits next to the id)
    assert c.network.identity_path.startswith(home) and c.metrics_dir.startswith(home)


def test_shipped_bootstrap_config_is_valid():
    c = build_config(BootstrapConfig, yaml_path=str(REPO / "bootstrap" / "bootstrap.yaml"), environ={})
    assert c.network.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]


def test_smollm2_trainer_deadlines_hold_on_a_20_mbit_link_and_the_tiny_ones_on_loopback():
    from echo_p2p.collab.optimizer import CollabOptimizerConfig, link_timeouts
    from echo_p2p.ml.models import PRESET_TRAINER_DEFAULTS

    preset = {
        k.rsplit(".", 1)[-1]: v for k, v in PRESET_TRAINER_DEFAULTS["smollm2"].items() if ".collab." in k
    }
    derived = link_timeouts(134_500_000, 20, compression=preset["compression"])
    assert {k: preset[k] for k in derived} == derived
    assert derived["load_state_timeout"] >= 1.5 * 134_500_000 * 12 / 2.5e6  # 1.6 GB at 2.5 MB/s, with margin
    tiny = link_timeouts(134_000, 1000, compression="none")
    defaults = CollabOptimizerConfig()
    assert tiny["averaging_timeout"] <= defaults.averaging_timeout and tiny["load_state_timeout"] <= 60
    CollabOptimizerConfig(**preset)  # a valid config


#: Every path setting of a peer's config (dotted); ``test_every_path_setting_expands_home_and_variables``
#: fails when a new one appears that is not listed here (and so perhaps not a ``paths.UserPath``).
PEER_PATH_FIELDS = {
    "network.identity_path",
    "metrics_dir",
    "run_record",
    "trusted_trainers",
    "trainer.checkpoint_dir",
    "trainer.report.dir",
    "run.model.path",
    "run.model.gguf_file",
}


def _path_like_fields(model, prefix: str = "") -> set[str]:
    import re

    from pydantic import BaseModel

    found = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= _path_like_fields(annotation, f"{prefix}{name}.")
        elif re.search(r"(path|file|dir|record|trusted_trainers)$", name) and "str" in str(annotation):
            found.add(prefix + name)
    return found


def test_every_path_setting_expands_home_and_variables(tmp_path, monkeypatch):
    """``~/.echo_p2p/...`` in peers/*.yaml used to land in a literal ./~/.echo_p2p/ for the files derived
    from a path (the peer cache next to the identity, the journal in the checkpoint dir)."""
    from echo_p2p.net.peer_cache import PeerCache

    assert _path_like_fields(PeerConfig) == PEER_PATH_FIELDS
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ECHO_TEST_DATA", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    values = {
        dotted: ("~/.echo_p2p/" if i % 2 else "$ECHO_TEST_DATA/") + dotted.replace(".", "_")
        for i, dotted in enumerate(sorted(PEER_PATH_FIELDS))
    }
    # a peer takes a run record or a trusted-trainers file, and a model directory or a GGUF file
    other = {"trusted_trainers": values.pop("trusted_trainers")}
    other["run.model.path"] = values.pop("run.model.path")
    (tmp_path / "data" / "peer.yaml").write_text("role: trainer\n")
    base = {"run_id": "r", "network.initial_peers": [MADDR]}
    # the --config path too, given with a variable as a quoted shell argument would leave it
    trainer = build_config(
        PeerConfig, yaml_path="${ECHO_TEST_DATA}/peer.yaml", environ={}, flags={**base, **values}
    )
    inference = build_config(PeerConfig, environ={}, flags={**base, "role": "inference", **other})
    for c, given in ((trainer, values), (inference, other)):
        for dotted, raw in given.items():
            got = c
            for part in dotted.split("."):
                got = getattr(got, part)
            want = raw.replace("~", str(home)).replace("$ECHO_TEST_DATA", str(tmp_path / "data"))
            assert got == want, (dotted, got)
    assert str(PeerCache.next_to(trainer.network.identity_path).path).startswith(str(tmp_path))
    bootstrap = build_config(
        BootstrapConfig,
        environ={"ECHO_IDENTITY_PATH": "~/.echo_p2p/bootstrap.id"},
        flags={"maddrs_file": "~/maddrs", "run_record": "$ECHO_TEST_DATA/run.record"},
    )
    assert bootstrap.network.identity_path == f"{home}/.echo_p2p/bootstrap.id"
    assert (bootstrap.maddrs_file, bootstrap.run_record) == (f"{home}/maddrs", f"{tmp_path}/data/run.record")
