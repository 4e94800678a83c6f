# FP8_RUNS entry `widen` of part `fp8` (loadtest/gpu/fp8.sh; results in $OUT/fp8/widen):
# FP8 products and attention on one GPU: the integer widening of e4m3 (kernels/fp8_widen.py,
# --fp8-widen bits) against Hopper's conversion instruction (the default), and FP8
# against bf16, single stream and ShareGPT-like. Each step's limit is below; a call of at most
# 10 minutes takes a part of them (SKIP="name ..." leaves steps out), e.g.
#     SKIP="tput_bf16 tput_fp8 tput_fp8kv8" FP8_RUNS=widen bash loadtest/gpu.sh fp8
#     SKIP="check attention lat_fp8_bits tput_fp8" FP8_RUNS=widen bash loadtest/gpu.sh fp8
# Steps:
#   check      fp8_bench.py check: every FP8 launch shape (both widenings) against the torch
#              reference, each widened-by-bits shape bit for bit against its conversion twin,
#              attention both ways too (60 s)
#   kernels    fp8_kernels_bench.py at 1 and 8 rows: every candidate's CUDA-graph time, both
#              widenings (150 s with a cold Triton cache)
#   attention  kv8_attention_bench.py: decode attention over bf16 / FP8 (cvt) / FP8 (bits) (60 s)
#   lat_*      fp8_bench.py run, single-stream latency only: bf16, FP8 weights, FP8 weights
#              with --fp8-widen bits (MESHSERVE_FP8_WIDEN=bits; 40 s each)
#   tput_*     fp8_bench.py run, latency and NUM_PROMPTS ShareGPT-like requests: bf16, FP8
#              weights, FP8 weights + FP8 KV cache (170 s each)
# Results in $OUT: <step>.json/.log, steps.log, summary.md (fp8_bench.py's tables).
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
NUM_PROMPTS=${NUM_PROMPTS:-800}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}

engine() {  # engine NAME LIMIT PROMPTS [ENV=VALUE...] -- ENGINE_FLAGS...
  local name=$1 limit=$2 prompts=$3 envs=()
  shift 3
  while [[ $# -gt 0 && $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  gpu_step "$name" "$limit" env "${envs[@]}" python3 loadtest/fp8_bench.py run --label "$name" \
    --out "$OUT/$name.json" --num-prompts "$prompts" -- --model "$MODEL_DIR" \
    --load-format dummy --max-model-len "$MAX_MODEL_LEN" "$@"
}
gpu_step check 120 python3 loadtest/fp8_bench.py check --out "$OUT/check.json"
gpu_step kernels 200 python3 loadtest/fp8_kernels_bench.py --fp8-widen bits --rows 1 8 \
  --out "$OUT/kernels.json"
gpu_step attention 150 python3 loadtest/kv8_attention_bench.py --cases 768x640,256x2048 \
  --out "$OUT/attention.json"
engine lat_bf16 110 0 --
engine lat_fp8 110 0 -- --quantization fp8
engine lat_fp8_bits 110 0 MESHSERVE_FP8_WIDEN=bits -- --quantization fp8
engine tput_bf16 180 "$NUM_PROMPTS" --
engine tput_fp8 180 "$NUM_PROMPTS" -- --quantization fp8
engine tput_fp8kv8 180 "$NUM_PROMPTS" -- --quantization fp8 --kv-cache-dtype fp8

: >"$OUT/summary.md"
fp8_report "single stream" lat_bf16 lat_fp8 lat_fp8_bits
fp8_report "ShareGPT-like" tput_bf16 tput_fp8 tput_fp8kv8
cat "$OUT/summary.md"
