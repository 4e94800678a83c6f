# FP8_RUNS entry `pairs` of part `fp8` (loadtest/gpu/fp8.sh; results in $OUT/fp8/pairs):
# FP8 weights against bf16 on a host with 2 GPUs, each configuration on both GPUs at the same
# time as the other (round 1: bf16 on GPU 0, fp8 on GPU 1; round 2 swapped), so both see the
# same host and the GPUs' own differences cancel. Each run is `loadtest/fp8_bench.py run`
# (single-stream TPOT 128 in / 128 out, ShareGPT-like throughput over NUM_PROMPTS, KV capacity,
# logprobs), the Llama-3.1-8B shape with dummy weights.
#     FP8_RUNS=pairs bash loadtest/gpu.sh fp8
#     FP8_FLAGS="--quantization fp8 --kv-cache-dtype fp8" ROUNDS=1 FP8_RUNS=pairs \
#       bash loadtest/gpu.sh fp8
# $OUT: r<round>_<label>.json and .log, summary_r1.md, summary_r2.md, env.txt.
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
NUM_PROMPTS=${NUM_PROMPTS:-800}
ROUNDS=${ROUNDS:-2}
read -r -a FP8_FLAGS <<<"${FP8_FLAGS:---quantization fp8}"
run() {  # run ROUND LABEL GPU EXTRA_FLAGS...
  local round=$1 label=$2 gpu=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 200 python3 loadtest/fp8_bench.py run --label "$label" \
    --out "$OUT/r${round}_$label.json" --num-prompts "$NUM_PROMPTS" -- --model "$MODEL_DIR" \
    --load-format dummy --max-model-len 4096 "$@" >"$OUT/r${round}_$label.log" 2>&1
  echo "== round $round $label on GPU $gpu: rc=$?"
}
for ((round = 1; round <= ROUNDS; round++)); do
  bf16_gpu=$((round - 1)) fp8_gpu=$((2 - round))
  run $round bf16 $bf16_gpu &
  run $round fp8 $fp8_gpu "${FP8_FLAGS[@]}" &
  wait
  python3 loadtest/fp8_bench.py report "$OUT/r${round}_bf16.json" "$OUT/r${round}_fp8.json" \
    --out "$OUT/summary_r$round.md"
done
