# Part `fp8` of loadtest/gpu.sh: FP8 weights, LM head and KV cache against bf16, the
# Llama-3.1-8B shape with dummy weights. FP8_RUNS (space-separated, default "base") picks the
# runs, each loadtest/gpu/fp8/RUN.sh with its files in $OUT/RUN/ (its own steps.log) and its
# own knobs (listed at the top of each file):
#   base   check, kernels, bf16 / fp8 / fp8 + FP8 KV cache runs and their table (< 4 minutes)
#   head   the FP8 LM head (--quantize-lm-head) against bf16 and FP8 weights, alternated
#   widen  the integer widening of e4m3 (--fp8-widen bits) against the conversion
#   mesh   bf16 and all-FP8 through `meshserve up` (loadtest/gpu/mesh_run.sh)
#   pairs  bf16 and FP8 at once on 2 GPUs, swapped between rounds
#   pdl    programmatic dependent launch off and on (2 GPUs)
# Most runs take a whole 10-minute call, some only a part of their steps (SKIP).
FP8_RUNS=${FP8_RUNS:-base}
fp8_status=0
for fp8_run in $FP8_RUNS; do
  if [ ! -f "loadtest/gpu/fp8/$fp8_run.sh" ]; then
    echo "!! unknown FP8_RUNS entry: $fp8_run" | tee -a "$OUT/steps.log"
    fp8_status=1
    continue
  fi
  echo "== fp8 $fp8_run" | tee -a "$OUT/steps.log"
  (
    OUT=$OUT/$fp8_run
    RUN_DIR=$(mktemp -d "$RUN_DIR/$fp8_run.XXXXXX")
    mkdir -p "$OUT"
    : >"$OUT/steps.log"
    # shellcheck source=/dev/null
    . "loadtest/gpu/fp8/$fp8_run.sh"
  ) || fp8_status=1
done
(exit $fp8_status)
