#!/usr/bin/env bash
# The run owner's command: `python -m echo_p2p.owner` (init, sign, show), with .venv set up on first use.
# E.g. `bash scripts/owner.sh init --run-id demo` makes the run's keys and record and prints the lines to run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "$ROOT/.venv/bin/python" -m echo_p2p.owner "$@"
