# Part `disagg` of loadtest/gpu.sh: disaggregated serving on 2 GPUs of one host. ONE prefill +
# ONE decode worker against TWO mixed workers behind the same router, on long-prompt traffic
# at a sweep of request rates, Llama-3.1-8B shape (dummy weights, a tokenizer of its
# vocabulary made by loadtest/make_tokenizer.py). Per config, in CONFIGS order: `meshserve
# up` (each worker on a GPU of its own), a short warm-up, one `meshserve bench serve
# --dataset long-prompt` per rate of RATES (arrivals at that rate, the same prompts for both
# configs), every service's /metrics once at the end (the KV handoff counters of the decode
# worker among them), then the stack stopped and its GPU memory given back before the next
# config starts. loadtest/disagg_sweep.py then writes the table, each config's goodput (the
# highest rate meeting TTFT p90 <= TTFT_SLO_MS and ITL p99 <= ITL_SLO_MS with no failed
# request) and the ratios.
#
#     bash loadtest/gpu.sh disagg                    # both configs; results in $OUT/disagg
#     CONFIGS="via whole" bash loadtest/gpu.sh disagg  # the short-prompt threshold (below)
#     CONFIGS=mixed bash loadtest/gpu.sh disagg      # one config per call, then
#     CONFIGS=disagg bash loadtest/gpu.sh disagg     # python loadtest/disagg_sweep.py here
#
# What comes back in $OUT: CONFIG/rate_R.json (the bench's result of rate R), CONFIG/
# warmup.json, CONFIG/metrics.json (every service's samples at the end), CONFIG/up.out and
# up.err, CONFIG/services.tar.gz (every service's log), CONFIG/steps.log, CONFIG/console.log;
# summary.md and summary.json. Both configs fit one call at the defaults (two budgets of
# CONFIG_BUDGET_S plus the stops): a slow start-up skips the last rates, not the call's end.
#
# Knobs: MODEL_DIR (a model folder; default loadtest/models/llama-3.1-8b: without a
# tokenizer.json one is made into a copy of it), CONFIGS ("mixed disagg"), RATES ("1 2 3 4
# 6" requests/s), PROMPTS_PER_RATE (40), KV_HANDOFF (tcp: `meshserve up --kv-handoff`),
# MAX_MODEL_LEN (8448), EXTRA_FLAGS (more `meshserve up` flags, for both configs),
# LONG_PROMPT_MIN_LEN / LONG_PROMPT_MAX_LEN (2048 / 8192), LONG_PROMPT_MIN_OUTPUT_LEN /
# LONG_PROMPT_MAX_OUTPUT_LEN (64 / 256), SEED (0; rate i uses SEED + i), TTFT_SLO_MS (2000),
# ITL_SLO_MS (50), MAX_CONCURRENCY (unset: no cap), REQUEST_TIMEOUT_S (60, one request),
# CONFIG_BUDGET_S (250: a config's start, warm-up and sweep; a rate that no longer fits its
# arrivals plus RATE_SLACK_S (30) is skipped and reported as such), STARTUP_S (240), PORT
# (8125).
#
# The short-prompt threshold (scheduler --disagg-min-prompt-tokens): the configs `via` (every
# prompt through the prefill worker) and `whole` (prompts up to the longest of SHORT_LENS run
# whole on the decode worker), both 1 prefill + 1 decode worker. Under a steady background of
# BG_STREAMS long-prompt streams (their prompts always go through the prefill worker; the
# short runs start BG_LEAD_S (10) seconds after them), one
# `bench serve` per prompt length L of SHORT_LENS: SHORT_PROMPTS random L-token prompts with
# SHORT_OUTPUT_LEN-token answers at SHORT_RATE req/s (CONFIG/short_L.json; the background,
# stopped after the last of them, leaves only CONFIG/background.log).
# loadtest/disagg_threshold.py then compares TTFT and ITL per length and names the measured
# threshold (summary_threshold.md).
#
# A CPU dry run (a tiny model with its own tokenizer, tests/tiny_models.py):
#     MODEL_DIR=/tmp/tiny MAX_MODEL_LEN=512 RATES="1 2" PROMPTS_PER_RATE=4 \
#       LONG_PROMPT_MIN_LEN=64 LONG_PROMPT_MAX_LEN=256 LONG_PROMPT_MIN_OUTPUT_LEN=8 \
#       LONG_PROMPT_MAX_OUTPUT_LEN=16 EXTRA_FLAGS="--device cpu --dtype float32" \
#       bash loadtest/gpu.sh disagg

MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
CONFIGS=${CONFIGS:-mixed disagg}
RATES=${RATES:-1 2 3 4 6}
PROMPTS_PER_RATE=${PROMPTS_PER_RATE:-40}
KV_HANDOFF=${KV_HANDOFF:-tcp}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8448}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
LONG_PROMPT_MIN_LEN=${LONG_PROMPT_MIN_LEN:-2048}
LONG_PROMPT_MAX_LEN=${LONG_PROMPT_MAX_LEN:-8192}
LONG_PROMPT_MIN_OUTPUT_LEN=${LONG_PROMPT_MIN_OUTPUT_LEN:-64}
LONG_PROMPT_MAX_OUTPUT_LEN=${LONG_PROMPT_MAX_OUTPUT_LEN:-256}
SEED=${SEED:-0}
TTFT_SLO_MS=${TTFT_SLO_MS:-2000}
ITL_SLO_MS=${ITL_SLO_MS:-50}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-}
REQUEST_TIMEOUT_S=${REQUEST_TIMEOUT_S:-60}
CONFIG_BUDGET_S=${CONFIG_BUDGET_S:-250}
RATE_SLACK_S=${RATE_SLACK_S:-30}
STARTUP_S=${STARTUP_S:-240}
SHORT_LENS=${SHORT_LENS:-16 64 256 1024}
SHORT_PROMPTS=${SHORT_PROMPTS:-40}
SHORT_RATE=${SHORT_RATE:-4}
SHORT_OUTPUT_LEN=${SHORT_OUTPUT_LEN:-64}
BG_STREAMS=${BG_STREAMS:-32}
BG_LEAD_S=${BG_LEAD_S:-10}
PORT=${PORT:-8125}
PART_OUT=$OUT
STEP_TAIL=3

# The model folder the mesh serves: MODEL_DIR itself when it has a tokenizer, else a copy
# with one of its config's vocabulary.
MODEL=$MODEL_DIR
if [ ! -f "$MODEL_DIR/tokenizer.json" ]; then
  MODEL=$RUN_DIR/model
  gpu_step tokenizer 120 python3 loadtest/make_tokenizer.py --config "$MODEL_DIR/config.json" \
    --out "$MODEL" || exit 1
fi

# `placement CONFIG`: the `meshserve up` flags placing CONFIG's two workers.
placement() {
  case $1 in
    mixed) echo "--workers 2" ;;
    disagg) echo "--workers 0 --prefill-workers 1 --decode-workers 1 --kv-handoff $KV_HANDOFF" ;;
    via) echo "$(placement disagg) --disagg-min-prompt-tokens 1" ;;
    whole) echo "$(placement disagg) --disagg-min-prompt-tokens $(($(longest_short) + 1))" ;;
    *) return 1 ;;
  esac
}

# `longest_short`: the longest prompt length of SHORT_LENS.
longest_short() {
  printf '%s\n' $SHORT_LENS | sort -n | tail -1
}

# `gpu_idle`: wait (at most 60 s) until no process holds GPU memory; true where there is no
# nvidia-smi (a CPU dry run).
gpu_idle() {
  command -v nvidia-smi >/dev/null || return 0
  local _
  for _ in $(seq 1 60); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "!! GPU memory still held after the stack stopped:" >&2
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >&2
  return 1
}

# `stack_up DIR FLAGS...`: `meshserve up` in the background (UP: its pid), its stdout in
# DIR/up.out, stderr in DIR/up.err; returns once it printed "meshserve is up", non-zero if
# it exited or took longer than STARTUP_S.
stack_up() {
  local dir=$1 _
  shift
  # shellcheck disable=SC2086  # EXTRA_FLAGS is a list of flags
  python3 -m "$MESHSERVE_CLI" up --model "$MODEL" --served-model-name m --port "$PORT" \
    --load-format dummy --max-model-len "$MAX_MODEL_LEN" --run-dir "$RUN_DIR/run_$(basename "$dir")" \
    --startup-timeout-s "$STARTUP_S" --stop-grace-s 10 "$@" $EXTRA_FLAGS \
    >"$dir/up.out" 2>"$dir/up.err" &
  UP=$!
  for _ in $(seq 1 $((2 * STARTUP_S))); do
    grep -q "^meshserve is up" "$dir/up.out" && return 0
    kill -0 "$UP" 2>/dev/null || break
    sleep 0.5
  done
  echo "!! meshserve up did not come up:"
  tail -30 "$dir/up.err"
  return 1
}

# `stack_down DIR`: the stack stopped, every service's log into DIR/services.tar.gz.
stack_down() {
  kill -TERM "$UP" 2>/dev/null
  wait "$UP" 2>/dev/null
  tar -czf "$1/services.tar.gz" -C "$RUN_DIR" "run_$(basename "$1")" 2>/dev/null
  gpu_idle
}

# `serve NAME LIMIT_S SEED FLAGS...`: one `meshserve bench serve` run on long prompts into
# $OUT/NAME.json (a step: its log in $OUT/NAME.log), TTFT, TPOT and ITL p50/p90/p99 in it.
serve() {
  local name=$1 limit=$2 seed=$3
  shift 3
  gpu_step "$name" "$limit" python3 -m "$MESHSERVE_CLI" bench serve \
    --base-url "http://127.0.0.1:$PORT" --model m --model-config "$MODEL" \
    --max-model-len "$MAX_MODEL_LEN" --prompt-format token-ids --ignore-eos --no-progress \
    --dataset long-prompt --long-prompt-min-len "$LONG_PROMPT_MIN_LEN" \
    --long-prompt-max-len "$LONG_PROMPT_MAX_LEN" \
    --long-prompt-min-output-len "$LONG_PROMPT_MIN_OUTPUT_LEN" \
    --long-prompt-max-output-len "$LONG_PROMPT_MAX_OUTPUT_LEN" \
    --seed "$seed" --timeout-s "$REQUEST_TIMEOUT_S" --num-warmup 0 \
    --percentile-metrics ttft,tpot,itl --metric-percentiles 50,90,99 \
    --output-json "$OUT/$name.json" "$@"
}

# `short_runs`: under a background of BG_STREAMS long-prompt streams, one run of short
# prompts per length of SHORT_LENS (the `via` and `whole` configs).
short_runs() {
  local len limit background span
  # The background's limit outlasts its lead and the short runs (their arrivals and a drain
  # each); it is stopped once they are done.
  span=$(python3 -c "import math; print($BG_LEAD_S + len('$SHORT_LENS'.split()) * (math.ceil($SHORT_PROMPTS / $SHORT_RATE) + 10) + 20)")
  ( serve background "$span" $((SEED + 2000)) --num-prompts $((BG_STREAMS * 50)) \
      --max-concurrency "$BG_STREAMS" ) >/dev/null 2>&1 &
  background=$!
  sleep "$BG_LEAD_S"  # its first burst of long prefills drained into a steady state
  for len in $SHORT_LENS; do
    limit=$(python3 -c "import math; print(math.ceil($SHORT_PROMPTS / $SHORT_RATE) + $RATE_SLACK_S)")
    gpu_step "short_$len" "$limit" python3 -m "$MESHSERVE_CLI" bench serve \
      --base-url "http://127.0.0.1:$PORT" --model m --model-config "$MODEL" \
      --max-model-len "$MAX_MODEL_LEN" --prompt-format token-ids --ignore-eos --no-progress \
      --dataset random --random-input-len "$len" --random-range-ratio 0 \
      --random-output-len "$SHORT_OUTPUT_LEN" --seed "$((SEED + len))" \
      --timeout-s "$REQUEST_TIMEOUT_S" --num-warmup 0 \
      --percentile-metrics ttft,tpot,itl --metric-percentiles 50,90,99 \
      --output-json "$OUT/short_$len.json" --num-prompts "$SHORT_PROMPTS" \
      --request-rate "$SHORT_RATE"
  done
  pkill -TERM -P "$background" 2>/dev/null  # its `timeout`, which stops the bench
  wait "$background" 2>/dev/null
}

# `sweep CONFIG`: CONFIG's stack up, warm-up, one run per rate, metrics, stack down.
sweep() {
  local config=$1 began=$SECONDS flags i=0 rate limit left cap=()
  flags=$(placement "$config") || { echo "!! unknown config: $config"; return 1; }
  [ -n "$MAX_CONCURRENCY" ] && cap=(--max-concurrency "$MAX_CONCURRENCY")
  echo "== config $config: meshserve up $flags $EXTRA_FLAGS ($(date -u +%H:%M:%S))"
  # shellcheck disable=SC2086  # flags is a list of flags
  stack_up "$OUT" $flags || { stack_down "$OUT"; return 1; }
  cat "$OUT/up.out"
  # Untimed: the first long prompts of each worker (compilation, allocation), another seed.
  serve warmup 60 $((SEED + 1000)) --num-prompts 4 --max-concurrency 2
  case $config in via | whole) short_runs ;; esac
  for rate in $RATES; do
    [[ $config == via || $config == whole ]] && break
    left=$((CONFIG_BUDGET_S - (SECONDS - began)))
    limit=$(python3 -c "import math; print(math.ceil($PROMPTS_PER_RATE / $rate) + $RATE_SLACK_S)")
    if ((limit > left)); then
      echo "== rate_$rate: skipped (needs ${limit}s, ${left}s of CONFIG_BUDGET_S left)" |
        tee -a "$OUT/steps.log"
    else
      serve "rate_$rate" "$limit" $((SEED + i)) --num-prompts "$PROMPTS_PER_RATE" \
        --request-rate "$rate" --goodput "ttft:$TTFT_SLO_MS" "tpot:$ITL_SLO_MS" "${cap[@]}"
    fi
    i=$((i + 1))
  done
  timeout 30 python3 loadtest/metrics_snapshot.py --up-output "$OUT/up.out" \
    --out "$OUT/metrics.json" || echo "!! scraping the services' metrics failed"
  stack_down "$OUT"
  echo "== config $config: done in $((SECONDS - began))s"
}

for config in $CONFIGS; do
  OUT=$PART_OUT/$config
  mkdir -p "$OUT"
  : >"$OUT/steps.log"
  sweep "$config" 2>&1 | tee "$OUT/console.log"
done
OUT=$PART_OUT
if [[ " $CONFIGS " == *" via "* && " $CONFIGS " == *" whole "* ]]; then
  # shellcheck disable=SC2086  # SHORT_LENS is a list
  python3 loadtest/disagg_threshold.py "$OUT" --lengths $SHORT_LENS \
    --out "$OUT/summary_threshold.md" --json "$OUT/summary_threshold.json"
fi
[[ " $CONFIGS " == *" mixed "* || " $CONFIGS " == *" disagg "* ]] || exit 0
# shellcheck disable=SC2086  # CONFIGS and RATES are lists
python3 loadtest/disagg_sweep.py "$OUT" --configs $CONFIGS --rates $RATES \
  --num-prompts "$PROMPTS_PER_RATE" --ttft-slo-ms "$TTFT_SLO_MS" --itl-slo-ms "$ITL_SLO_MS" \
  --out "$OUT/summary.md" --json "$OUT/summary.json"
