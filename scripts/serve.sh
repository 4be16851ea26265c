#!/usr/bin/env bash
# The main job on a fresh machine: install (idempotent), build the local tiny model if it
# is missing, and serve the default graph. Extra arguments go to `dynamo serve`
# (e.g. --Frontend.port=8080). GRAPH / CONFIG pick another graph.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRAPH="${GRAPH:-graphs.disagg_router:Frontend}"
CONFIG="${CONFIG:-configs/disagg_router.yaml}"
bash "${REPO}/scripts/install.sh"
cd "${REPO}"
"${REPO}/.venv/bin/python" -m tools.model_builder --out "${REPO}/models/tiny-llama"
exec "${REPO}/.venv/bin/dynamo" serve "${GRAPH}" -f "${CONFIG}" "$@"
