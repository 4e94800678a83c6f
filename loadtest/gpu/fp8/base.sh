# FP8_RUNS entry `base` of part `fp8` (loadtest/gpu/fp8.sh; results in $OUT/fp8/base):
# FP8 weights and the FP8 KV cache against bf16 on one GPU, with the Llama-3.1-8B shape
# (dummy weights; loadtest/models/llama-3.1-8b), in under 4 minutes:
#
#     bash loadtest/gpu.sh fp8          # FP8_RUNS=base, the default
#
# Steps, each under `timeout` within a total budget (FP8_BUDGET_S, 240 s):
#   check     loadtest/fp8_bench.py check: the FP8 GPU paths (the Triton skinny FP8 product,
#             torch._scaled_mm with per-token x per-channel scales, paged attention over an
#             FP8 cache) against their torch references, and FP8 vs bf16 product times
#   kernels   loadtest/fp8_kernels_bench.py: per Llama-8B layer shape (qkv, o, gate_up, down)
#             and rows 1, 8, 16, 64, 256, the bf16 and FP8 products' times and GB/s, which
#             FP8 path ran (the measured Triton launch shape, or quantize + _scaled_mm split)
#   bf16      loadtest/fp8_bench.py run: single-stream TPOT (128 in / 128 out), ShareGPT-like
#             offline throughput (NUM_PROMPTS, 800), KV capacity, logprobs of fixed prompts
#   fp8       the same with --quantization fp8
#   fp8_kv8   the same with --quantization fp8 --kv-cache-dtype fp8
#   report    the table: TPOT and throughput against bf16 (targets <= 0.6x and >= 1.3x),
#             KV tokens per byte (2x), logprob differences from bf16 on the same dummy weights
# $OUT gets env.txt, fp8.log (every step's output), check.json, kernels.json + kernels.md,
# <run>.json, summary.md and summary.json. Knobs: MODEL_DIR, NUM_PROMPTS, ENGINE_FLAGS, FP8_BUDGET_S.

: >"$OUT/fp8.log"
START=$SECONDS
BUDGET_S=${FP8_BUDGET_S:-240}
NUM_PROMPTS=${NUM_PROMPTS:-800}
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
ENGINE_FLAGS=${ENGINE_FLAGS:---load-format dummy --max-model-len 4096}

log() { echo "$*" | tee -a "$OUT/fp8.log"; }

step() {  # step NAME LIMIT_S COMMAND...: under timeout, never past the budget
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  if ((left < 20)); then
    log "== $name: skipped (${left}s left)"
    return
  fi
  ((limit > left)) && limit=$left
  local began=$SECONDS
  log "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" >>"$OUT/fp8.log" 2>&1
  local rc=$?
  log "== $name: rc=$rc in $((SECONDS - began))s"
}

run() {  # run LABEL LIMIT_S EXTRA_FLAGS...
  local label=$1 limit=$2
  shift 2
  # shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
  step "$label" "$limit" python3 loadtest/fp8_bench.py run --label "$label" \
    --out "$OUT/$label.json" --num-prompts "$NUM_PROMPTS" -- --model "$MODEL_DIR" \
    $ENGINE_FLAGS "$@"
}

step check 40 python3 loadtest/fp8_bench.py check --out "$OUT/check.json"
step kernels 45 python3 loadtest/fp8_kernels_bench.py --out "$OUT/kernels.json"
run bf16 70
run fp8 70 --quantization fp8
run fp8_kv8 70 --quantization fp8 --kv-cache-dtype fp8
runs=()
for label in bf16 fp8 fp8_kv8; do
  [[ -f "$OUT/$label.json" ]] && runs+=("$OUT/$label.json")
done
if ((${#runs[@]} >= 2)) && [[ -f "$OUT/bf16.json" ]]; then
  python3 loadtest/fp8_bench.py report "${runs[@]}" --out "$OUT/summary.md" | tee -a "$OUT/fp8.log"
else
  log "!! too few runs finished for a comparison (see fp8.log)"
fi
grep -h '"ok"' "$OUT/check.json" 2>/dev/null | tail -1 | sed 's/^ */check: /'
[[ -f "$OUT/kernels.md" ]] && cat "$OUT/kernels.md"
log "== fp8 base finished in $((SECONDS - START))s"
