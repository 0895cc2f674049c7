"""What the KL penalty's reference policy costs in memory: resident memory of a trainer's
policy with and without the frozen reference (``train.reference``), and the peak of one GRPO step with it.

Each arm runs in a fresh interpreter (resident memory is not given back reliably within one): load the
policy as a trainer does (``load_policy``, fp32, ``policy_precision`` bf16 as trainer peers set it), read
the resident size, build the reference when ``kl_beta`` > 0 and read it again, then take one
``Learner.compute_gradients`` over ``--sequences`` random completions of ``--tokens`` tokens after a real
prompt of the task and read the process's high-water mark (``VmHWM``). Parameters are counted as
``numel * element size``. Prints a table and writes JSON.

``python benchmarks/kl_memory.py [--models tiny,smollm2] [--out benchmarks/results/kl-memory.json]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def arm(model: str, kl_beta: float, sequences: int, tokens: int) -> dict:
    """One arm in this process (the parent runs each in its own interpreter)."""
    import random

    import torch

    sys.path.insert(0, str(ROOT))
    from echo_p2p.ml.models import ModelSpec, load_policy
    from echo_p2p.ml.tokenizer import encode_prompts
    from echo_p2p.rollout import Completion, RolloutGroup
    from echo_p2p.tasks.registry import build_task
    from echo_p2p.train.config import DerivedSettings, GRPOConfig
    from echo_p2p.train.learner import Learner
    from echo_p2p.train.reference import reference_policy
    from echo_p2p.train.scored import ScoredGroup

    torch.set_num_threads(2)
    policy, tokenizer = load_policy(ModelSpec(preset=model))
    policy.eval()
    params = sum(p.numel() * p.element_size() for p in policy.parameters())
    loaded = status_kib("VmRSS") * 1024
    config = GRPOConfig(kl_beta=kl_beta)
    derived = DerivedSettings(policy_precision="bf16", pad_token_id=tokenizer.pad_token_id or 0)
    reference = reference_policy(policy, derived.policy_precision) if kl_beta > 0 else None
    with_reference = status_kib("VmRSS") * 1024
    task = build_task("arithmetic" if model == "smollm2" else "count", {})
    prompt = encode_prompts(tokenizer, [task.prompt(0)])[0]
    rng = random.Random(0)
    vocab = len(tokenizer)
    groups = []
    for _ in range(max(1, sequences // 4)):
        completions = [
            Completion(
                token_ids=[rng.randrange(3, vocab) for _ in range(tokens)],
                logprobs=[-2.0] * tokens,
                claimed_reward=0.0,
            )
            for _ in range(4)
        ]
        group = RolloutGroup(
            task=task.name, prompt_id=0, prompt_token_ids=prompt, completions=completions, policy_version=0
        )
        groups.append(ScoredGroup(group, [float(i % 2) for i in range(4)]))
    stats = Learner(policy, config, ref_model=reference).compute_gradients(groups)
    return {
        "model": model,
        "kl_beta": kl_beta,
        "parameters_mib": round(params / MIB, 1),
        "rss_loaded_mib": round(loaded / MIB, 1),
        "rss_with_reference_mib": round(with_reference / MIB, 1),
        "reference_mib": round((with_reference - loaded) / MIB, 1),
        "peak_rss_after_step_mib": round(status_kib("VmHWM") / 1024, 1),
        "kl": stats.get("kl"),
        "sequences": sequences,
        "completion_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--kl-beta", type=float, default=0.04)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kl-memory.json"))
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: model,kl_beta
    args = p.parse_args(argv)
    if args.arm:
        model, beta = args.arm.split(",")
        print(json.dumps(arm(model, float(beta), args.sequences, args.tokens)))
        return 0
    rows = []
    for model in args.models.split(","):
        for beta in (0.0, args.kl_beta):
            out = subprocess.run(
                [sys.executable, __file__, "--arm", f"{model},{beta}"]
                + ["--sequences", str(args.sequences), "--tokens", str(args.tokens)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(
                f"{model:8s} kl_beta {beta:<5g} params {row['parameters_mib']:7.1f} MiB  loaded "
                f"{row['rss_loaded_mib']:7.1f}  +reference {row['reference_mib']:7.1f}  "
                f"peak after one step {row['peak_rss_after_step_mib']:7.1f} MiB",
                flush=True,
            )
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "command": " ".join(["python benchmarks/kl_memory.py", *(argv or sys.argv[1:])]),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
