"""Benchmark of the weight codec: bytes on the wire, encode/decode time, and policy fidelity.

(a) Wire: for models of ~1M, ~30M and ~135M parameters (random init from configs; 135M = SmolLM2-135M's
    shape), the payload bytes per version of each encoding relative to fp32, and the time to encode a
    version (publisher) and to verify + decode it (receiver).
(b) Fidelity: a ~1M-parameter model is first trained briefly on a synthetic Markov language (so that its
    next-token distributions are peaked, like a real LM's), then takes 50 AdamW steps at an RL-sized
    learning rate; after each step every encoder publishes a version and a receiver applies it. Reported:
    KL(trainer || receiver) per token on fixed prompts, for int8-delta with and without error feedback,
    int8 full snapshots and bf16 full snapshots.

Run: ``python benchmarks/weights_codec.py [--quick] [--out PATH]`` (default run ~2-3 min on 2 CPU cores).
Uses only `echo_p2p.weights` and transformers; no networking.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen3Config

from echo_p2p.weights.codec import EncodedVersion, VersionAssembler, WeightEncoder
from echo_p2p.weights.config import EncodingConfig
from echo_p2p.weights.model_io import PolicyWeights, load_into_model, named_tensors

ENCODINGS = ("fp32", "bf16", "int8", "int8-delta")


def model_config(size: str) -> PretrainedConfig:
    if size == "1M":
        return Qwen3Config(
            vocab_size=1024,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=512,
            tie_word_embeddings=True,
        )
    if size == "30M":
        return Qwen3Config(
            vocab_size=8192,
            hidden_size=384,
            num_hidden_layers=16,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1024,
            tie_word_embeddings=True,
        )
    if size == "135M":  # SmolLM2-135M
        return LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        )
    raise ValueError(size)


def build_model(size: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(model_config(size)).eval()


def make_encoder(encoding: str, *, error_feedback: bool = True, chunk_size: int = 4 << 20) -> WeightEncoder:
    config = EncodingConfig(
        encoding=encoding, chunk_size=chunk_size, keyframe_interval=10, error_feedback=error_feedback
    )
    return WeightEncoder(config, run_id="bench", publisher="QmBenchPublisher", publisher_key=b"k" * 270)


def receive(encoded: EncodedVersion, current: PolicyWeights | None) -> PolicyWeights:
    assembler = VersionAssembler(encoded.manifest)
    for index in range(encoded.manifest.num_chunks):
        assembler.add_chunk(index, encoded.get_chunk(index))
    return assembler.apply(current, inplace=current is not None)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def bench_wire(size: str) -> list[dict]:
    model = build_model(size)
    tensors = named_tensors(model)
    n_params = sum(t.numel() for _, t in tensors)
    fp32_bytes = 4 * n_params
    rows = []
    for encoding in ENCODINGS:
        enc = make_encoder(encoding)
        first, t_enc0 = timed(enc.encode, tensors, 0)
        _, t_dec0 = timed(receive, first[-1], None)
        row = dict(model=size, params=n_params, encoding=encoding)
        if encoding != "int8-delta":
            (version,) = first
            row.update(bytes=version.nbytes, encode_s=t_enc0, decode_s=t_dec0)
        else:  # follower: version 1 as a delta on version 0; newcomer: the keyframe
            current = receive(first[0], None)
            with torch.no_grad():
                for _, t in tensors:
                    if t.is_floating_point():
                        t.add_(torch.randn_like(t), alpha=1e-5)
            (delta,), t_enc1 = timed(enc.encode, tensors, 1)
            _, t_dec1 = timed(receive, delta, current)
            row.update(bytes=delta.nbytes, encode_s=t_enc1, decode_s=t_dec1)
            row.update(keyframe_bytes=first[0].nbytes, keyframe_encode_s=t_enc0, keyframe_decode_s=t_dec0)
            # publisher upload per version with keyframes every 10 versions (delta always, keyframe 1 in 10)
            row["publisher_ratio_k10"] = (delta.nbytes + first[0].nbytes / 10) / fp32_bytes
            del current
        row["ratio"] = row["bytes"] / fp32_bytes
        row["chunks"] = math.ceil(row["bytes"] / (4 << 20))
        row["manifest_bytes"] = len(
            first[-1].manifest.model_copy(update={"signature": b"s" * 256}).to_bytes()
        )
        rows.append(row)
        print(
            f"  {size:>5} {encoding:>10}  {row['ratio']:.4f} x fp32  {row['bytes'] / 2**20:8.2f} MiB"
            f"  encode {row['encode_s']:6.2f} s  decode {row['decode_s']:6.2f} s",
            flush=True,
        )
        del enc, first
    return rows


class MarkovLanguage:
    """A synthetic language: each token has 4 possible successors with probabilities 0.7/0.2/0.07/0.03."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.successors = torch.randint(0, vocab, (vocab, 4), generator=self.gen)
        self.probs = torch.tensor([0.7, 0.2, 0.07, 0.03])

    def batch(self, n: int, length: int) -> torch.Tensor:
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, self.vocab, (n,), generator=self.gen)
        for i in range(1, length):
            pick = torch.multinomial(self.probs, n, replacement=True, generator=self.gen)
            x[:, i] = self.successors[x[:, i - 1], pick]
        return x


def kl_per_token(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p_log = F.log_softmax(p_logits.double(), -1)
    q_log = F.log_softmax(q_logits.double(), -1)
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def bench_fidelity(versions: int, lrs: list[float], pretrain_steps: int) -> list[dict]:
    size = "1M"
    lang = MarkovLanguage(model_config(size).vocab_size)
    trainer = build_model(size).train()
    opt = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    for _ in range(pretrain_steps):
        x = lang.batch(16, 32)
        loss = trainer(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"  pretrained {pretrain_steps} steps, loss {loss.item():.3f} (entropy floor 0.86)", flush=True)
    pretrained = {name: t.clone() for name, t in trainer.state_dict().items()}
    prompts = lang.batch(32, 32)
    variants = {
        "int8-delta (error feedback)": dict(encoding="int8-delta", error_feedback=True),
        "int8-delta (no error feedback)": dict(encoding="int8-delta", error_feedback=False),
        "int8 snapshots": dict(encoding="int8"),
        "bf16 snapshots": dict(encoding="bf16"),
    }
    receiver_model = build_model(size)
    rows = []
    for lr in lrs:
        trainer.load_state_dict(pretrained)
        opt = torch.optim.AdamW(trainer.parameters(), lr=lr, weight_decay=0.0)
        encoders = {
            k: make_encoder(v["encoding"], error_feedback=v.get("error_feedback", True))
            for k, v in variants.items()
        }
        held: dict[str, PolicyWeights | None] = dict.fromkeys(variants)
        kls: dict[str, list[float]] = {k: [] for k in variants}
        errs: dict[str, list[float]] = {k: [] for k in variants}
        start = time.perf_counter()
        for version in range(versions + 1):
            if version:
                x = lang.batch(16, 32)
                loss = trainer(input_ids=x, labels=x).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
            tensors = named_tensors(trainer)
            with torch.no_grad():
                reference = trainer(input_ids=prompts).logits
            if version == 0:
                initial = reference
            for name, enc in encoders.items():
                published = enc.encode(tensors, version)
                follow = published[0]  # the delta (or version 0's keyframe, or the snapshot)
                held[name] = receive(follow, held[name] if not follow.is_keyframe else None)
                errs[name].append(
                    max((held[name].tensors[n].float() - t).abs().max().item() for n, t in tensors)
                )
                load_into_model(receiver_model, held[name])
                with torch.no_grad():
                    kls[name].append(kl_per_token(reference, receiver_model(input_ids=prompts).logits))
        moved = max((t - pretrained[n]).abs().max().item() for n, t in trainer.state_dict().items())
        policy_change = kl_per_token(reference, initial)  # how far the true policy moved in these versions
        print(f"  lr {lr:.0e}: KL(trainer v{versions} || trainer v0) = {policy_change:.2e}", flush=True)
        for name in variants:
            weight_err = errs[name][-1]
            rows.append(
                dict(
                    lr=lr,
                    versions=versions,
                    variant=name,
                    kl_final=kls[name][-1],
                    kl_max=max(kls[name]),
                    kl_by_version=kls[name],
                    max_abs_weight_error=weight_err,
                    max_abs_weight_error_v10=errs[name][min(10, versions)],
                    weight_error_by_version=errs[name],
                    max_abs_weight_change=moved,
                    policy_change_kl=policy_change,
                )
            )
            print(
                f"  lr {lr:.0e} {name:>32}: KL/token final {kls[name][-1]:.2e}  max {max(kls[name]):.2e}"
                f"  |w err| {weight_err:.1e} (weights moved up to {moved:.1e})",
                flush=True,
            )
        print(f"  ({versions} versions in {time.perf_counter() - start:.1f} s)", flush=True)
    return rows


def print_tables(wire: list[dict], fidelity: list[dict]) -> None:
    print("\n| model | params | encoding | bytes/version | x fp32 | encode s | decode s | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in wire:
        note = ""
        if r["encoding"] == "int8-delta":
            note = (
                f"keyframe {r['keyframe_bytes'] / 2**20:.1f} MiB ({r['keyframe_encode_s']:.2f} s / "
                f"{r['keyframe_decode_s']:.2f} s); publisher upload at K=10: "
                f"{r['publisher_ratio_k10']:.3f} x fp32"
            )
        print(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['encoding']} | {r['bytes'] / 2**20:.2f} MiB "
            f"| {r['ratio']:.4f} | {r['encode_s']:.2f} | {r['decode_s']:.2f} | {note} |"
        )
    print("\n| lr | variant | KL/token final | KL/token max | max abs w error v10 / final | policy moved |")
    print("|---|---|---|---|---|---|")
    for r in fidelity:
        print(
            f"| {r['lr']:.0e} | {r['variant']} | {r['kl_final']:.2e} | {r['kl_max']:.2e} "
            f"| {r['max_abs_weight_error_v10']:.1e} / {r['max_abs_weight_error']:.1e} "
            f"| KL {r['policy_change_kl']:.1e}, max abs {r['max_abs_weight_change']:.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/weights_codec.json", help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="small run: 1M and 30M models, 20 versions")
    parser.add_argument("--sizes", nargs="*", help="model sizes for the wire part (1M 30M 135M)")
    parser.add_argument("--versions", type=int, help="versions in the fidelity part (default 50, quick 20)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = args.sizes or (["1M", "30M"] if args.quick else ["1M", "30M", "135M"])
    versions = args.versions or (20 if args.quick else 50)
    lrs = [1e-5] if args.quick else [1e-6, 1e-5]
    started = time.perf_counter()
    make_encoder("int8").encode([("warm_up", torch.ones(8))], 0)  # import bitsandbytes outside the timings
    print("(a) bytes on the wire per version and encode/decode time", flush=True)
    wire = [row for size in sizes for row in bench_wire(size)]
    print(f"(b) fidelity over {versions} versions", flush=True)
    fidelity = bench_fidelity(versions, lrs, pretrain_steps=80 if args.quick else 150)
    print_tables(wire, fidelity)
    elapsed = time.perf_counter() - started
    print(f"\ntotal {elapsed:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = dict(
        settings=dict(sizes=sizes, versions=versions, lrs=lrs, threads=args.threads, chunk_size=4 << 20),
        wire=wire,
        fidelity=fidelity,
        elapsed_s=elapsed,
    )
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
