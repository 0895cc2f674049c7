#!/usr/bin/env bash
# The whole test suite: lint, then unit and integration tests (real processes on 127.0.0.1 only).
# Sets up .venv on first use. Extra arguments go to pytest (which then runs what they name, in one process).
# The monitor's browser tests need Chromium: run as root, this installs Debian's `chromium` package when it is
# missing (ECHO_NO_BROWSER_INSTALL=1 turns that off); without it those tests skip with the install line.
# The NAT tests (tests/netlab.py: network namespaces, nftables masquerade) need root and nftables: installed
# the same way (ECHO_NO_NETLAB_INSTALL=1 turns that off); without root they skip with the reason.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the Debian packages install in the background while pip fills .venv (pip works on one core; ~30 s less)
apt_installs() {
  if [ "${ECHO_NO_BROWSER_INSTALL:-0}" != "1" ] && [ "$(id -u)" = "0" ] && ! command -v chromium >/dev/null \
    && command -v apt-get >/dev/null; then
    echo "[test] installing chromium for the monitor's browser tests (ECHO_NO_BROWSER_INSTALL=1 skips this)" >&2
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; } \
      || echo "[test] could not install chromium: the browser tests will skip" >&2
  fi
  if [ "${ECHO_NO_NETLAB_INSTALL:-0}" != "1" ] && [ "$(id -u)" = "0" ] && ! command -v nft >/dev/null \
    && command -v apt-get >/dev/null; then
    echo "[test] installing nftables for the NAT tests (ECHO_NO_NETLAB_INSTALL=1 skips this)" >&2
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 nftables >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 nftables >/dev/null; }; } \
      || echo "[test] could not install nftables: the NAT tests will skip" >&2
  fi
}
apt_installs &
apt_pid=$!
setup_status=0
bash "$ROOT/scripts/setup.sh" || setup_status=$?
wait "$apt_pid" || true
[ "$setup_status" = "0" ] || exit "$setup_status"
cd "$ROOT"
"$ROOT/.venv/bin/ruff" check echo_p2p tests benchmarks
"$ROOT/.venv/bin/ruff" format --check echo_p2p tests benchmarks
PYTEST=("$ROOT/.venv/bin/python" -m pytest -p no:cacheprovider -q --durations=10)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# the whole suite: the unit tests (CPU-bound) on both cores at once (worksteal: an idle worker takes queued
# tests from the busy one, so the slow ones at the end do not leave a core idle), then the integration tests
# two files at a time (--dist loadfile: a file's tests, and the run a module shares, stay on one worker; the
# files marked slow start first, the longest first: xdist's own reorder, by number of tests, is turned off; it
# started the 80-second single-test files last, with one core left idle at the end). A swarm test keeps its machine busy ~70% of the time (starting processes,
# waiting on peers), so two of them share 2 cores with deadlines to spare; the suite was ~15 minutes one file
# at a time
status=0
"${PYTEST[@]}" -n 2 --dist worksteal tests/unit || status=$?
"${PYTEST[@]}" -n 2 --dist loadfile --no-loadscope-reorder tests/integration || status=$?
exit "$status"
