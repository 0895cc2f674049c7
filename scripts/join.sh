#!/usr/bin/env bash
# A donor's one command: an inference peer joins a run (`python -m echo_p2p.peer --role inference`), with
# .venv set up on first use. E.g. `bash scripts/join.sh --join RUN:OWNER@MADDR --model tiny --task count`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "$ROOT/.venv/bin/python" -m echo_p2p.peer --role inference "$@"
