#!/usr/bin/env bash
# Proves compose/grafana/dashboards/meshserve.json against a real Prometheus: starts
# `meshserve up` (a tiny random model unless MODEL is set), points a Prometheus server at
# every service's own /metrics port (from what `up` printed), drives load through the
# openai client, then runs compose/check_dashboard.py, which fails on any empty panel query.
#
#   compose/dashboard_check.sh            # PYTHON, MODEL, PROMETHEUS, LOAD_SECONDS, WORK_DIR
#
# Needs a `prometheus` binary (Debian/Ubuntu: apt-get install prometheus) and meshserve
# importable by $PYTHON (with its test extra for the tiny model).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PROMETHEUS=${PROMETHEUS:-prometheus}
LOAD_SECONDS=${LOAD_SECONDS:-40}
WORK=${WORK_DIR:-$(mktemp -d -t meshserve-dashboard-XXXX)}
METRICS_BASE=${METRICS_BASE:-19100}
PROM_PORT=${PROM_PORT:-19090}
mkdir -p "$WORK"
echo "work dir: $WORK"

if [[ -z "${MODEL:-}" ]]; then
  MODEL="$WORK/model"
  PYTHONPATH="tests:${PYTHONPATH:-}" "$PYTHON" -c "
from pathlib import Path; from tiny_models import build_tiny_model
build_tiny_model(Path('$MODEL'), 'llama', seed=7, max_position_embeddings=1024)"
  EXTRA=(--dtype float32 --device cpu --num-kv-blocks 256)
else
  EXTRA=()
fi

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

"$PYTHON" -m meshserve.cli.main up "$MODEL" --served-model-name tiny --port 0 \
  --metrics-port "$METRICS_BASE" --run-dir "$WORK/run" "${EXTRA[@]}" >"$WORK/up.out" 2>"$WORK/up.err" &
pids+=($!)
for _ in $(seq 1 600); do
  grep -q "^metrics all" "$WORK/up.out" 2>/dev/null && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$WORK/up.err"; exit 1; }
  sleep 0.5
done
grep -q "^metrics all" "$WORK/up.out" || { echo "meshserve up did not come up"; exit 1; }
cat "$WORK/up.out"
BASE_URL=$(sed -n 's/^meshserve is up: \([^ ]*\) .*/\1/p' "$WORK/up.out")

# One scrape job per role (gateway, tokenizer, scheduler, kvstore, worker, launcher).
"$PYTHON" - "$WORK/up.out" >"$WORK/prometheus.yml" <<'PY'
import re, sys
jobs = {}
for line in open(sys.argv[1]):
    m = re.match(r"metrics ([\w-]+): http://([^/]+)/metrics$", line.strip())
    if m:
        jobs.setdefault(re.sub(r"-\d+$", "", m.group(1)), []).append(m.group(2))
print("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:")
for job, targets in jobs.items():
    print(f"  - job_name: {job}\n    static_configs:\n      - targets: {targets!r}")
PY
cat "$WORK/prometheus.yml"
"$PROMETHEUS" --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
pids+=($!)

"$PYTHON" compose/dashboard_load.py --base-url "$BASE_URL" --model tiny --seconds "$LOAD_SECONDS"
sleep 3  # let the last scrapes after the load land (1 s interval)
"$PYTHON" compose/check_dashboard.py --prometheus "http://127.0.0.1:$PROM_PORT" \
  --rate-interval "$((LOAD_SECONDS + 20))s"
