# Part `lora` of loadtest/gpu.sh: multi-LoRA serving on one GPU, in process, with the
# Llama-3.1-8B shape (dummy bf16 weights):
#   check    the LoRA Triton kernels against the grouped torch reference at 8B shapes
#   adapters 8 random PEFT adapters of rank 16 on all seven projections (ADAPTERS, RANK)
#   base     an engine without LoRA: ShareGPT-like throughput (PROMPTS requests, ~200 in /
#            ~180 out; the mean of PASSES passes) and single-stream time per output token
#   lora     an engine with --enable-lora --max-loras 8: the same requests on the base model,
#            then spread round-robin over the 8 adapters; the adapters' consistency check
#            (greedy tokens alone / mixed / vs base, first-position max |logit diff| vs base)
#            with CUDA graphs; single-stream TPOT with and without an adapter
#   eager    the consistency check again with --enforce-eager, also with the grouped torch
#            path in place of the Triton kernels (a graph problem apart from a kernel one)
#   summary  the table (summary.md) and every figure (lora.json), graph vs eager logits;
#            target: adapters' output throughput >= 0.8 x the no-LoRA engine's
#
#     bash loadtest/gpu.sh lora                     # results in $OUT/lora
#     QUANTIZATION=fp8 bash loadtest/gpu.sh lora    # the base weights in FP8, adapters in bf16
#
# Every step runs under `timeout`; the limits add up to 285 s (the steps took about 3 minutes
# on an H200). Knobs: MODEL_DIR, ADAPTERS, RANK, PROMPTS, PASSES, QUANTIZATION.

MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
ADAPTERS=${ADAPTERS:-8}
RANK=${RANK:-16}
PROMPTS=${PROMPTS:-800}  # two passes of 800 fit the limits (one of 1000 took ~20 s, H200)
PASSES=${PASSES:-2}

BENCH=(python3 loadtest/lora_bench.py)
RUN=(run --model "$MODEL_DIR" --load-format dummy --dtype bfloat16 --max-model-len 2048
     --num-prompts "$PROMPTS" --passes "$PASSES" ${QUANTIZATION:+--quantization "$QUANTIZATION"})
LORA=(--adapters "$RUN_DIR/adapters" --count "$ADAPTERS" --rank "$RANK")
gpu_step check 20 "${BENCH[@]}" check --out "$OUT/check.json"
gpu_step adapters 20 "${BENCH[@]}" adapters --model "$MODEL_DIR" --out "$RUN_DIR/adapters" \
  --count "$ADAPTERS" --rank "$RANK"
BASE_LIMIT=70
[[ -n ${QUANTIZATION:-} ]] && BASE_LIMIT=120  # FP8 engines time their launch shapes at start
gpu_step base "$BASE_LIMIT" "${BENCH[@]}" "${RUN[@]}" --out "$OUT/base.json"
gpu_step lora 115 "${BENCH[@]}" "${RUN[@]}" "${LORA[@]}" --out "$OUT/lora_run.json"
gpu_step eager 50 "${BENCH[@]}" "${RUN[@]}" "${LORA[@]}" --enforce-eager --consistency-only \
  --out "$OUT/eager.json"
gpu_step summary 10 "${BENCH[@]}" summary --base "$OUT/base.json" --lora "$OUT/lora_run.json" \
  --eager "$OUT/eager.json" --out-md "$OUT/summary.md" --out-json "$OUT/lora.json"
cat "$OUT/summary.md" 2>/dev/null || echo "no summary (see $OUT/steps.log)"
