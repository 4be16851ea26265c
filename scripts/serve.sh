#!/usr/bin/env bash
# The main job on a fresh machine: install (idempotent), build the local tiny model if it
# is missing, and serve the default graph. Extra arguments go to `dynamo serve`
# (e.g. --Frontend.port=8080). GRAPH / CONFIG pick another graph.
#
# Each step says what it does and how long it took; the first run installs the engine
# (a few minutes, with a progress bar) and trains the model (about two minutes, with a
# percentage); later runs get to `dynamo serve` in seconds.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRAPH="${GRAPH:-graphs.disagg_router:Frontend}"
CONFIG="${CONFIG:-configs/disagg_router.yaml}"
MODEL="${REPO}/models/tiny-llama"

t() { date +%s; }
took() { local s=$(( $(t) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }

t0=$(t)
echo "serve.sh: [1/3] install (scripts/install.sh) ..."
bash "${REPO}/scripts/install.sh"
echo "serve.sh: [1/3] install: ready ($(took "${t0}"))"

cd "${REPO}"
t0=$(t)
if "${REPO}/.venv/bin/python" -c "import sys; from tools.model_builder import is_complete; \
sys.exit(0 if is_complete(__import__('pathlib').Path(sys.argv[1])) else 1)" "${MODEL}"; then
    echo "serve.sh: [2/3] model: ${MODEL#"${REPO}"/} is built"
else
    echo "serve.sh: [2/3] model: building ${MODEL#"${REPO}"/} (first run only, 1-5 minutes) ..."
    "${REPO}/.venv/bin/python" -m tools.model_builder --out "${MODEL}" >/dev/null
    echo "serve.sh: [2/3] model: built in $(took "${t0}")"
fi

echo "serve.sh: [3/3] dynamo serve ${GRAPH} -f ${CONFIG} $* (Ctrl-C stops it)"
exec "${REPO}/.venv/bin/dynamo" serve "${GRAPH}" -f "${CONFIG}" "$@"
