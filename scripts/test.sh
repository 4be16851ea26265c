#!/usr/bin/env bash
# Install everything (idempotent) and run the test suite. Extra arguments go to pytest:
#   scripts/test.sh                                  # everything (what CI runs)
#   scripts/test.sh -m "not integration and not vllm and not nixl"   # the fast set, seconds
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "${REPO}/scripts/install.sh"
cd "${REPO}"
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1
exec "${REPO}/.venv/bin/python" -m pytest "$@"
