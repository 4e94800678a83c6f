# Part `metrics` of loadtest/gpu.sh: vLLM-named metrics of the mesh on a GPU, under load: `meshserve up` on a Llama-3.1-8B-shaped
# model (dummy weights), `meshserve bench serve` (1000 ShareGPT-like requests at once, then a
# prefix-heavy run), each service's /metrics scraped before and after. Reports whether the
# counters agree with what the benchmark received, the worker's vs the gateway's TTFT and
# ITL (the mesh's share), queue/prefill/decode time, prefix-cache hit rate, preemptions, and
# how long a /metrics and the merged /metrics/all scrape take while 1000 streams run.
#
#     bash loadtest/gpu.sh metrics            # results in $OUT/metrics
#
# Writes $OUT/metrics.json (every figure, the scrapes' raw sums) and $OUT/metrics.md (the
# table), and prints the table. Finishes in under 6 minutes (each step under `timeout`).
# Knobs: MODEL_DIR (a model config folder; default loadtest/models/llama-3.1-8b),
# PROMPTS (1000), PREFIX_PROMPTS (500), ENGINE_FLAGS, PREFIX_FLAGS (extra bench flags of the
# prefix-heavy run), DURING_S (10: when the timed scrapes run, into the big run).

MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
PROMPTS=${PROMPTS:-1000}
PREFIX_PROMPTS=${PREFIX_PROMPTS:-500}
ENGINE_FLAGS=${ENGINE_FLAGS:---load-format dummy --max-model-len 4096}
METRICS_BASE=${METRICS_BASE:-19100}
PORT=${PORT:-8124}
PREFIX_FLAGS=${PREFIX_FLAGS:-}
DURING_S=${DURING_S:-10}

RUN=$RUN_DIR

timeout 60 python3 loadtest/make_tokenizer.py --config "$MODEL_DIR/config.json" \
  --out "$RUN/model" || { echo "making the tokenizer failed"; exit 1; }

# shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
timeout 330 python3 -m "$MESHSERVE_CLI" up --model "$RUN/model" --served-model-name m \
  --port "$PORT" --metrics-port "$METRICS_BASE" --run-dir "$RUN/run" --startup-timeout-s 240 \
  --stop-grace-s 5 $ENGINE_FLAGS >"$RUN/up.out" 2>"$RUN/up.err" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null; cp "$RUN/up.err" "$OUT/up.err" 2>/dev/null' EXIT
for _ in $(seq 1 500); do
  grep -q "^metrics all" "$RUN/up.out" && break
  kill -0 "$UP" 2>/dev/null || { tail -40 "$RUN/up.err"; exit 1; }
  sleep 0.5
done
grep -q "^metrics all" "$RUN/up.out" || { echo "stack not up in time"; tail -40 "$RUN/up.err"; exit 1; }
cat "$RUN/up.out"

scrape() {  # scrape NAME: every service's metrics as JSON into $RUN/NAME.json
  timeout 30 python3 loadtest/metrics_snapshot.py --up-output "$RUN/up.out" \
    --out "$RUN/$1.json"
}
serve() {  # serve NAME FLAGS...: one bench serve run into $RUN/NAME.json
  local name=$1
  shift
  timeout 150 python3 -m "$MESHSERVE_CLI" bench serve \
    --base-url "http://127.0.0.1:$PORT" --model m --model-config "$RUN/model" \
    --prompt-format token-ids --no-progress --num-warmup 8 --output-json "$RUN/$name.json" "$@"
}

scrape before
# Scrape timings while the big run is in flight (10 s in: every request admitted).
( sleep "$DURING_S"; timeout 60 python3 loadtest/metrics_snapshot.py --up-output "$RUN/up.out" \
    --time-scrapes --out "$RUN/during.json" ) &
TIMER=$!
serve sharegpt --dataset sharegpt-like --num-prompts "$PROMPTS" --seed 0 --ignore-eos
wait "$TIMER"
scrape middle
# shellcheck disable=SC2086  # PREFIX_FLAGS is a list of flags
serve prefix --dataset prefix-heavy --num-prompts "$PREFIX_PROMPTS" --max-concurrency 64 \
  --seed 1 $PREFIX_FLAGS
scrape after

python3 loadtest/metrics_snapshot.py --report --run-dir "$RUN" --out "$OUT/metrics.json" \
  --summary "$OUT/metrics.md"
cat "$OUT/metrics.md"
