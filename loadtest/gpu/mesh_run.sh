#!/usr/bin/env bash
# The mesh under load, as a user runs it: `meshserve up` on a model, then `meshserve bench
# serve` against its gateway. Run by the parts `mesh` (loadtest/gpu/suite.sh's mesh section,
# after the in-process runs of the same prompts), `tp` and `fp8` (FP8_RUNS=mesh) of
# loadtest/gpu.sh, in the environment its preamble set up (PYTHONPATH, MESHSERVE_CLI):
#
#     bash loadtest/gpu/mesh_run.sh MODEL_DIR OUT_DIR [engine flags...]
#
# MODEL_DIR needs a tokenizer of the model's vocabulary (loadtest/make_tokenizer.py). Writes
# into OUT_DIR:
#   mesh_sharegpt.json      1000 ShareGPT-like requests at once (--num-prompts SHAREGPT_PROMPTS)
#   mesh_sweep_C.json       the same mix at max concurrency C, for C in SWEEP (prompts per point:
#                           4 x C, at least 8, at most SHAREGPT_PROMPTS)
#   mesh_latency.json       single stream, random LATENCY_LEN in / LATENCY_LEN out
#                           (LATENCY_PROMPTS requests)
#   worker_metrics.json     the worker's engine and KV tier counters before and after the
#                           1000-request run
#   pyspy_ROLE.txt          raw py-spy samples of gateway, scheduler, tokenizer and worker
#                           during that run (when py-spy works there)
#   worker_steps.jsonl.W    every engine step of worker W (--step-trace), all runs
#   up.log, run/            `meshserve up`'s output and every service's log
# Knobs: GATEWAYS (1, `meshserve up`'s default; 0: one per 8 cores), PORT (8123), SWEEP ("1 16 64 256 1024"), SHAREGPT_PROMPTS (1000),
# LATENCY_LEN (128), LATENCY_PROMPTS (8), PYSPY_S (12; 0: no py-spy, whose sampling slows the
# services it reads).
set -uo pipefail

MODEL=$1
OUT_DIR=$2
shift 2
ENGINE=("$@")
GATEWAYS=${GATEWAYS:-1}
PORT=${PORT:-8123}
SWEEP=${SWEEP:-1 16 64 256 1024}
SHAREGPT_PROMPTS=${SHAREGPT_PROMPTS:-1000}
LATENCY_LEN=${LATENCY_LEN:-128}
LATENCY_PROMPTS=${LATENCY_PROMPTS:-8}
PYSPY_S=${PYSPY_S:-12}
NAME=mesh-model
mkdir -p "$OUT_DIR/run"

python3 -m "${MESHSERVE_CLI:-meshserve.cli.main}" up --model "$MODEL" --served-model-name "$NAME" \
  --port "$PORT" --gateways "$GATEWAYS" --run-dir "$OUT_DIR/run" --startup-timeout-s 400 \
  --stop-grace-s 10 --step-trace "$OUT_DIR/worker_steps.jsonl" "${ENGINE[@]}" \
  >"$OUT_DIR/up.log" 2>&1 &
UP=$!
stop_stack() {
  kill -TERM "$UP" 2>/dev/null
  wait "$UP" 2>/dev/null
}
trap stop_stack EXIT

# `meshserve up` prints "meshserve is up" once every service is healthy.
for _ in $(seq 1 800); do
  grep -q "meshserve is up" "$OUT_DIR/up.log" && break
  if ! kill -0 "$UP" 2>/dev/null; then
    echo "meshserve up exited while starting:"
    tail -50 "$OUT_DIR/up.log"
    exit 1
  fi
  sleep 0.5
done
grep -q "meshserve is up" "$OUT_DIR/up.log" || { echo "stack not up in time"; exit 1; }
cat "$OUT_DIR/up.log"
WORKER_METRICS=$(grep -o 'worker-0 ready (http[^)]*)' "$OUT_DIR/up.log" | grep -o 'http[^)]*')
pid_of() { pgrep -f "meshserve.services.$1" | head -1; }

serve() {  # serve NAME FLAGS...: one `meshserve bench serve` run into OUT_DIR/NAME.json
  local name=$1
  shift
  echo "== bench serve $name: $*"
  python3 -m "${MESHSERVE_CLI:-meshserve.cli.main}" bench serve --base-url "http://127.0.0.1:$PORT" \
    --model "$NAME" --model-config "$MODEL" --prompt-format token-ids --ignore-eos \
    --no-progress --num-warmup 8 --output-json "$OUT_DIR/$name.json" "$@"
}

scrape() {  # the worker's engine counters as JSON
  python3 - "$WORKER_METRICS" <<'PY'
import json, sys, time, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
wanted = ("meshserve:worker_engine_steps", "meshserve:worker_engine_step_seconds",
          "meshserve:worker_engine_tokens")
values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
          if line.split() and (line.split()[0] in wanted
                               or line.startswith("meshserve:worker_kvstore_"))}
print(json.dumps({"unix_s": time.time(), **values}))
PY
}

# 1. Every request at once, the in-process engine's workload (same seed, same prompts).
BEFORE=$(scrape)
PYSPY=""
if ((PYSPY_S > 0)) && command -v py-spy >/dev/null; then
  ( sleep 1  # the warm-up requests first
    for role in gateway scheduler tokenizer; do
      py-spy record -f raw -r 50 -d "$PYSPY_S" --pid "$(pid_of "$role")" \
        -o "$OUT_DIR/pyspy_$role.txt" >/dev/null 2>&1 &
    done
    py-spy record -f raw -r 50 -d "$PYSPY_S" --threads --pid "$(pid_of worker)" \
      -o "$OUT_DIR/pyspy_worker.txt" >/dev/null 2>&1 &
    wait ) &
  PYSPY=$!
fi
# A full-size warm-up burst first (another seed, 16 tokens each), as the in-process run gets.
serve mesh_sharegpt --dataset sharegpt-like --num-prompts "$SHAREGPT_PROMPTS" --seed 0 \
  --num-warmup "$SHAREGPT_PROMPTS"
AFTER=$(scrape)
printf '{"before": %s, "after": %s}\n' "$BEFORE" "$AFTER" >"$OUT_DIR/worker_metrics.json"
[ -n "$PYSPY" ] && wait "$PYSPY"

# 2. The concurrency sweep on the same mix.
for c in $SWEEP; do
  n=$((4 * c))
  ((n < 8)) && n=8
  ((n > SHAREGPT_PROMPTS)) && n=$SHAREGPT_PROMPTS
  # A seed of its own per point: prompts run before would be prefix-cache hits.
  serve "mesh_sweep_$c" --dataset sharegpt-like --num-prompts "$n" --max-concurrency "$c" \
    --seed $((1000 + c))
done

# 3. One stream at a time, the in-process latency benchmark's shape.
serve mesh_latency --dataset random --seed 7 --random-input-len "$LATENCY_LEN" \
  --random-output-len "$LATENCY_LEN" \
  --num-prompts "$LATENCY_PROMPTS" --max-concurrency 1
echo "== mesh runs done"
