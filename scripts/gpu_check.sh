#!/usr/bin/env bash
# One-shot check of the GPU paths, for a machine with one NVIDIA GPU (about 10 minutes, most of it installing):
#   0. the donor's set-up (scripts/setup.sh --cuda) and the peer's machine check for cuda:0;
#   1. builds .venv-vllm with vLLM's CUDA build (scripts/setup_vllm.sh cuda);
#   2. benchmarks/engines.py on the GPU, tiny preset and SmolLM2-135M: tokens/s of vLLM against the
#      transformers engine, and of bitsandbytes 8-bit / 4-bit on CUDA, with each engine's behaviour log-probs
#      against the fp32 trainer's (mean |diff|, share of tokens outside the PPO clip), before and after a
#      weight update;
#   3. a swarm: an inference peer with engine: vllm on the GPU serving a local CPU trainer
#      (tests/integration/test_vllm_peer.py);
#   4. benchmarks/objectives.py on SmolLM2-135M: reward per update of an fp32 policy trained from its own,
#      8-bit and 4-bit samples under the ppo and decoupled objectives (where quantised samplers put a quarter
#      to a half of their tokens outside the clip; the tiny model's quantisation barely moves its log-probs).
# Results: benchmarks/results/engines-cuda-*.json, objectives-cuda-smollm2.json and the printed tables. Nothing leaves the machine.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# 0. the donor's set-up: .venv with a CUDA build of torch, and the peer's machine check passes for cuda:0
bash scripts/setup.sh --cuda || echo "[gpu-check] setup.sh --cuda failed: the donor's path needs work" >&2
.venv/bin/python -c 'from echo_p2p.ml.machine import machine_problems; from echo_p2p.ml.models import ModelSpec
p = machine_problems(ModelSpec(preset="tiny", device="cuda:0", dtype="bfloat16")); print("[gpu-check] machine check:", p or "ok"); assert not p' \
  || echo "[gpu-check] the machine check refuses this GPU" >&2
bash scripts/setup_vllm.sh cuda || { echo "[gpu-check] could not build the vLLM environment" >&2; exit 1; }
PY="$ROOT/.venv-vllm/bin/python"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible to torch"' || exit 1
status=0
"$PY" benchmarks/engines.py --model tiny --device cuda --vllm-dtype float32 --prompts 64 --group 8 \
  --out benchmarks/results/engines-cuda-tiny.json || status=1
"$PY" benchmarks/engines.py --model smollm2 --device cuda --vllm-dtype bfloat16 --prompts 64 --group 8 \
  --out benchmarks/results/engines-cuda-smollm2.json || status=1
"$PY" benchmarks/objectives.py --model smollm2 --device cuda --micro-batch-size 64 --samplers fp32,8bit,4bit \
  --objectives ppo,decoupled --seeds 1 --updates 100 --lr 1e-5 --eval-every 10 \
  --out benchmarks/results/objectives-cuda-smollm2.json || status=1
ECHO_VLLM_PYTHON="$PY" "$PY" -m pytest -p no:cacheprovider -q -rA tests/integration/test_vllm_peer.py \
  tests/unit/ml/test_engine_vllm.py || status=1
exit $status
