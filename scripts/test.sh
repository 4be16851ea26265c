#!/usr/bin/env bash
# Install everything (idempotent) and run the test suite. Extra arguments go to pytest:
#   scripts/test.sh                                  # everything (what CI runs)
#   scripts/test.sh -m "not integration and not vllm and not nixl"   # the fast set, seconds
# Tests run in DYNAGRAPH_TEST_WORKERS (default 2) pytest-xdist workers, one package at a
# time per worker (a package's served graph starts once; see tests/conftest.py); the
# served tests wait on their graphs most of the time. DYNAGRAPH_TEST_WORKERS=0: one process.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "${REPO}/scripts/install.sh"
cd "${REPO}"
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
workers="${DYNAGRAPH_TEST_WORKERS:-2}"
parallel=()
if [[ "${workers}" != 0 ]]; then
    parallel=(-n "${workers}" --dist loadgroup)
fi
exec "${REPO}/.venv/bin/python" -m pytest "${parallel[@]}" "$@"
