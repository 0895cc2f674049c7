"""Export from a trainer checkpoint: the model directory loads offline with ``from_pretrained`` and its
log-probs equal the trainer's policy exactly in the exported dtype (fp32: the fp32 master weights; bf16:
their bf16 cast, which is also the policy the trainer's loss sees at ``policy_precision`` bf16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo_p2p.config import RunSettings
from echo_p2p.export.checkpoint import export_checkpoint, find_checkpoint, newest_checkpoint
from echo_p2p.export.config import EXPORT_INFO_FILE, ExportConfig, ExportError
from echo_p2p.export.policy_files import policy_files, policy_meta
from echo_p2p.ml.models import ModelSpec, build_tiny_policy
from echo_p2p.ml.tokenizer import encode_prompts
from echo_p2p.train.checkpoint import CheckpointManager
from echo_p2p.train.forward import rounded_weights
from echo_p2p.train.grpo import token_logprobs

REPO = Path(__file__).resolve().parents[3]
TEXTS = ["3a=aaa", "5c=ccccc", "1e=e", "6b=bbbbbb", "2d=dd"]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def trained_policy(steps: int = 3):
    """The tiny preset after a few AdamW steps at lr 1e-2: fp32 master weights off the bf16 grid, as a
    trainer's are after updates."""
    model, tokenizer = build_tiny_policy(seed=0)
    ids = torch.tensor([[4 + (i * 7 + j) % 30 for j in range(12)] for i in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        logits = model(ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), tokenizer, optimizer


def logprobs(model, tokenizer) -> torch.Tensor:
    """Token log-probs of a few task strings, as the trainer computes them (``token_logprobs``)."""
    rows = encode_prompts(tokenizer, TEXTS, use_chat_template=False)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    return token_logprobs(logits, ids)


def bf16_cast(model):
    """The trainer's weights cast to bf16 in a model transformers builds at bf16 (its rotary frequencies
    stay fp32, as ``from_pretrained`` keeps them; ``model.to(bfloat16)`` would round them too)."""
    from transformers import AutoModelForCausalLM

    cast = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    cast.load_state_dict(model.state_dict())  # each value rounded to bf16 as torch's .to() rounds it
    return cast.eval()


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory):
    """(trained model, tokenizer, checkpoint directory) written as the trainer peer writes checkpoints."""
    torch.set_num_threads(1)
    model, tokenizer, optimizer = trained_policy()
    directory = tmp_path_factory.mktemp("ckpt")
    CheckpointManager(directory).save(
        7,
        model.state_dict(),
        optimizer.state_dict(),
        {"steps": 3, **policy_meta(RunSettings(temperature=0.7, top_k=20), "bf16")},
        files=policy_files(model, tokenizer),
    )
    return model, tokenizer, directory


def load(out: Path, dtype=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(out, local_files_only=True)


def test_float32_export_has_the_trainers_exact_log_probs(trainer_checkpoint, tmp_path):
    model, tokenizer, directory = trainer_checkpoint
    result = export_checkpoint(directory, ExportConfig(out=str(tmp_path / "m"), dtype="float32"))
    assert result.version == 7 and result.dtype == "float32"
    names = {p.name for p in Path(result.path).iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    exported, exported_tokenizer = load(Path(result.path))
    assert exported.dtype == torch.float32
    assert torch.equal(logprobs(exported, exported_tokenizer), logprobs(model, tokenizer))
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name


def test_default_export_is_the_serving_bfloat16_policy_exactly(trainer_checkpoint, tmp_path):
    """The checkpoint says its inference peers hold bf16: the default export is bf16, equal to the trainer's
    bf16 cast computed in bf16, and loaded in fp32 it is exactly the policy the trainer's loss sees."""
    model, tokenizer, directory = trainer_checkpoint
    result = export_checkpoint(directory, ExportConfig(out=str(tmp_path / "m")))
    assert result.dtype == "bfloat16"
    exported, exported_tokenizer = load(Path(result.path))
    assert exported.dtype == torch.bfloat16
    cast = bf16_cast(model)
    assert torch.equal(logprobs(exported, exported_tokenizer), logprobs(cast, tokenizer))
    in_fp32, _ = load(Path(result.path), dtype=torch.float32)
    with rounded_weights(model, "bf16"):  # the trainer's policy at policy_precision bf16
        policy = logprobs(model, tokenizer)
    assert torch.equal(logprobs(in_fp32, exported_tokenizer), policy)
    assert not torch.equal(policy, logprobs(model, tokenizer))  # the weights were off the bf16 grid


def test_export_carries_the_tokenizer_generation_config_and_provenance(trainer_checkpoint, tmp_path):
    model, tokenizer, directory = trainer_checkpoint
    out = Path(export_checkpoint(directory, ExportConfig(out=str(tmp_path / "m"))).path)
    _, exported_tokenizer = load(out)
    assert encode_prompts(exported_tokenizer, TEXTS) == encode_prompts(tokenizer, TEXTS)
    assert exported_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert exported_tokenizer.pad_token_id == tokenizer.pad_token_id
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    assert generation["do_sample"] is True and generation["temperature"] == 0.7 and generation["top_k"] == 20
    info = json.loads((out / EXPORT_INFO_FILE).read_text())
    assert info["source"] == "checkpoint" and info["version"] == 7 and info["dtype"] == "bfloat16"
    assert info["checkpoint"] == str(find_checkpoint(directory).path.resolve())


def test_an_older_checkpoint_needs_the_model_and_then_exports_exactly(tmp_path):
    """A checkpoint without config and tokenizer files (written before they were attached) is refused
    with the flags to pass; given the model, it exports (bf16: nothing says what the samplers held)."""
    model, tokenizer, optimizer = trained_policy(steps=1)
    CheckpointManager(tmp_path / "old").save(3, model.state_dict(), optimizer.state_dict(), {"steps": 1})
    with pytest.raises(ExportError, match="--model tiny"):
        export_checkpoint(tmp_path / "old", ExportConfig(out=str(tmp_path / "a")))
    assert not (tmp_path / "a").exists()
    result = export_checkpoint(
        tmp_path / "old", ExportConfig(out=str(tmp_path / "b"), model=ModelSpec(preset="tiny", seed=5))
    )
    assert result.dtype == "bfloat16" and result.version == 3
    exported, _ = load(Path(result.path), dtype=torch.float32)
    with rounded_weights(model, "bf16"):
        assert torch.equal(logprobs(exported, tokenizer), logprobs(model, tokenizer))


def test_refusals_are_clear_and_leave_nothing_behind(trainer_checkpoint, tmp_path):
    model, tokenizer, directory = trainer_checkpoint
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(directory, ExportConfig(out=str(tmp_path / "full")))
    assert (tmp_path / "full" / "x").read_text() == "mine"
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export_checkpoint(tmp_path / "full", ExportConfig(out=str(tmp_path / "o")))
    # fp16 cannot hold a weight of 1e6: refused, not written as infinity
    big, _, optimizer = trained_policy(steps=1)
    with torch.no_grad():
        big.model.norm.weight[0] = 1e6
    CheckpointManager(tmp_path / "big").save(1, big.state_dict(), None, files=policy_files(big, tokenizer))
    with pytest.raises(ExportError, match="float16's range"):
        export_checkpoint(tmp_path / "big", ExportConfig(out=str(tmp_path / "o"), dtype="float16"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".o")] == []
    # a tokenizer file that does not match its digest in meta.json
    ckpt = find_checkpoint(tmp_path / "big")
    (ckpt.path / "tokenizer.json").write_bytes(b"{}" + (ckpt.path / "tokenizer.json").read_bytes()[2:])
    with pytest.raises(ExportError, match="sha256"):
        export_checkpoint(ckpt.path, ExportConfig(out=str(tmp_path / "o")))


def test_newest_checkpoint_among_trainers(tmp_path):
    model, _, _ = trained_policy(steps=0)
    state = model.state_dict()
    CheckpointManager(tmp_path / "t0").save(4, state)
    CheckpointManager(tmp_path / "t1").save(6, state)
    CheckpointManager(tmp_path / "t1").save(6, state)
    newest = newest_checkpoint([tmp_path / "t0", tmp_path / "t1", tmp_path / "missing"])
    assert newest is not None and newest.version == 6 and newest.seq == 2
    assert newest_checkpoint([tmp_path / "missing"]) is None


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echo_p2p.export", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_cli_exports_and_fails_with_exit_codes(trainer_checkpoint, tmp_path):
    _, _, directory = trainer_checkpoint
    done = run_cli("--checkpoint", str(directory), "--out", str(tmp_path / "m"), "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "exported policy version 7 (float32)" in done.stdout
    assert (tmp_path / "m" / "model.safetensors").is_file()
    again = run_cli("--checkpoint", str(directory), "--out", str(tmp_path / "m"))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    missing = run_cli("--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "n"))
    assert missing.returncode == 1 and "no checkpoint at" in missing.stderr
    both = run_cli("--checkpoint", str(directory), "--run-id", "x", "--out", str(tmp_path / "n"))
    assert both.returncode == 2 and "one source" in both.stderr
    maddr = "/ip4/127.0.0.1/tcp/1/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"
    untrusted = run_cli("--run-id", "x", "--initial-peers", maddr, "--out", str(tmp_path / "n"))
    assert untrusted.returncode == 2 and "--trusted-trainers" in untrusted.stderr


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from echo_p2p.export.__main__ import build_parser\n"
        "build_parser().format_help()\n"
        "print([m for m in ('torch', 'hivemind', 'transformers') if m in sys.modules])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
