#!/usr/bin/env bash
# The main job: a whole echo_p2p swarm on this machine (bootstrap, trainer, inference peers on 127.0.0.1).
# Sets up .venv on first use. Extra arguments go to `python -m echo_p2p.local` (see --help).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m echo_p2p.local "$@"
