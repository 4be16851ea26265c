#!/usr/bin/env bash
# Start Debian's Prometheus (apt-get install prometheus) on 127.0.0.1 against a
# running graph, for users without Docker. Its data lives in a temporary directory
# that is removed when it stops (Ctrl-C / SIGTERM).
#
#   bash scripts/prometheus.sh TARGETS_FILE
#
# TARGETS_FILE is the file_sd file `dynamo serve` keeps current from discovery: the
# path printed after the ready banner ("prometheus targets: ..."), or the file named
# by DYNAMO_PROMETHEUS_SD when the graph was started. It lists every component
# process plus etcd and a NATS exporter, so a graph that scales needs no edit here.
#
# Environment: PROMETHEUS_PORT (default 9090; 0 picks a free port),
# PROMETHEUS_SCRAPE_INTERVAL (default 5s), PROMETHEUS_RETENTION (default 1d).
# Prints "prometheus ready at http://127.0.0.1:PORT" once it answers /-/ready.
set -euo pipefail

targets="${1:-}"
if [[ -z "${targets}" ]]; then
    echo "usage: $0 TARGETS_FILE   (printed by 'dynamo serve' after its ready banner)" >&2
    exit 2
fi
targets="$(realpath -m "${targets}")"
if [[ ! -f "${targets}" ]]; then
    echo "$0: ${targets} does not exist (is the graph running?)" >&2
    exit 2
fi
prom="$(command -v prometheus || true)"
if [[ -z "${prom}" ]]; then
    echo "$0: prometheus not found; install Debian's package: apt-get install -y prometheus" >&2
    exit 1
fi

port="${PROMETHEUS_PORT:-9090}"
if [[ "${port}" == "0" ]]; then
    port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
interval="${PROMETHEUS_SCRAPE_INTERVAL:-5s}"
dir="$(mktemp -d -t dynagraph-prometheus-XXXXXX)"
pid=""
cleanup() {
    if [[ -n "${pid}" ]] && kill -0 "${pid}" 2>/dev/null; then
        kill -TERM "${pid}" 2>/dev/null || true
        wait "${pid}" 2>/dev/null || true
    fi
    rm -rf "${dir}"
}
trap cleanup EXIT
trap 'exit 0' INT TERM

cat >"${dir}/prometheus.yml" <<YAML
global:
  scrape_interval: ${interval}
  scrape_timeout: ${interval}
  evaluation_interval: ${interval}
scrape_configs:
  - job_name: dynagraph
    file_sd_configs:
      - files: ['${targets}']
        refresh_interval: 5s
  - job_name: prometheus
    static_configs:
      - targets: ['127.0.0.1:${port}']
YAML

"${prom}" --config.file="${dir}/prometheus.yml" --storage.tsdb.path="${dir}/data" \
    --storage.tsdb.retention.time="${PROMETHEUS_RETENTION:-1d}" \
    --web.listen-address="127.0.0.1:${port}" --log.level=warn &
pid=$!

for _ in $(seq 1 300); do
    if ! kill -0 "${pid}" 2>/dev/null; then
        echo "$0: prometheus exited while starting" >&2
        exit 1
    fi
    if curl -fs "http://127.0.0.1:${port}/-/ready" >/dev/null 2>&1; then
        echo "prometheus ready at http://127.0.0.1:${port} (targets: ${targets}, data: ${dir})"
        break
    fi
    sleep 0.1
done
curl -fs "http://127.0.0.1:${port}/-/ready" >/dev/null 2>&1 \
    || { echo "$0: prometheus not ready after 30s" >&2; exit 1; }
wait "${pid}"
