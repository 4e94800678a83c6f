# FP8_RUNS entry `head` of part `fp8` (loadtest/gpu/fp8.sh; results in $OUT/fp8/head):
# The FP8 LM head (--quantize-lm-head) on one GPU, Llama-3.1-8B shape with dummy weights:
# single-stream TPOT and ShareGPT-like throughput of bf16, FP8 weights, and FP8 weights with
# the LM head in FP8 too, alternated within one call (machines differ more than the
# configurations do), the LM head's product at 1 and 8 rows, and FP8 logprobs against bf16
# on a random model whose logits are not flat (loadtest/fp8_logprobs.py). SKIP="name ..."
# leaves steps out; a call of at most 10 minutes takes a part of them, e.g.
#     SKIP="tput_bf16_1 tput_fp8kv8_1 tput_fp8kv8_head_1 tput_bf16_2 tput_fp8kv8_2
#           tput_fp8kv8_head_2" FP8_RUNS=head bash loadtest/gpu.sh fp8
#     SKIP="kernels logprobs lat_bf16 lat_fp8 lat_fp8_head lat_bf16_2 lat_fp8_head_2" \
#         FP8_RUNS=head bash loadtest/gpu.sh fp8
# Steps (limits): kernels (120 s), logprobs (150 s), split_probe (every skinny launch
# shape against the torch reference, 120 s), lat_* (110 s each), tput_* (180 s each;
# two passes of the three configurations, alternated).
# Results in $OUT: <step>.json/.log, steps.log, summary.md (fp8_bench.py's tables).
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
NUM_PROMPTS=${NUM_PROMPTS:-800}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}

engine() {  # engine NAME LIMIT PROMPTS -- ENGINE_FLAGS...
  local name=$1 limit=$2 prompts=$3
  shift 4
  gpu_step "$name" "$limit" python3 loadtest/fp8_bench.py run --label "$name" \
    --out "$OUT/$name.json" --num-prompts "$prompts" -- --model "$MODEL_DIR" \
    --load-format dummy --max-model-len "$MAX_MODEL_LEN" "$@"
}
HEAD=(--quantization fp8 --quantize-lm-head)
gpu_step kernels 120 python3 loadtest/fp8_kernels_bench.py --shapes lm_head --rows 1 8 \
  --out "$OUT/kernels.json"
gpu_step logprobs 150 python3 loadtest/fp8_logprobs.py --out "$OUT/logprobs.json"
gpu_step split_probe 120 python3 loadtest/fp8_split_probe.py --out "$OUT/split_probe.json"
engine lat_bf16 110 0 --
engine lat_fp8 110 0 -- --quantization fp8
engine lat_fp8_head 110 0 -- "${HEAD[@]}"
engine lat_bf16_2 110 0 --
engine lat_fp8_head_2 110 0 -- "${HEAD[@]}"
for pass in 1 2; do  # alternated: each configuration twice
  engine "tput_bf16_$pass" 180 "$NUM_PROMPTS" --
  engine "tput_fp8kv8_$pass" 180 "$NUM_PROMPTS" -- --quantization fp8 --kv-cache-dtype fp8
  engine "tput_fp8kv8_head_$pass" 180 "$NUM_PROMPTS" -- "${HEAD[@]}" --kv-cache-dtype fp8
done

: >"$OUT/summary.md"
fp8_report "single stream" lat_bf16 lat_fp8 lat_fp8_head lat_bf16_2 lat_fp8_head_2
fp8_report "ShareGPT-like, pass 1" tput_bf16_1 tput_fp8kv8_1 tput_fp8kv8_head_1
fp8_report "ShareGPT-like, pass 2" tput_bf16_2 tput_fp8kv8_2 tput_fp8kv8_head_2
cat "$OUT/summary.md"
