#!/usr/bin/env bash
# The whole test suite: lint, then unit and integration tests (real processes on 127.0.0.1 only).
# Sets up .venv on first use. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check echo_p2p tests benchmarks
"$ROOT/.venv/bin/ruff" format --check echo_p2p tests benchmarks
exec "$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -q --durations=10 "$@"
