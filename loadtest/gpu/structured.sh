# Part `structured` of loadtest/gpu.sh: structured outputs on one GPU: correctness of the
# overlapped loop's constrained steps and of the masking kernel
# (tests/gpu/test_gpu_structured.py, its figures in $OUT/structured.json), then the half-json_schema
# batch against the free batch and compile times (loadtest/structured_bench.py) with the
# Llama-3.1-8B shape (dummy bf16 weights, a tokenizer of its vocabulary made by
# loadtest/make_tokenizer.py). Results in $OUT: steps.log, check.log, structured.json,
# structured_8b.json. Knobs: MODEL_DIR, SKIP_CHECK (set: no check), REQUESTS (256),
# MAX_TOKENS (256).
#
#     bash loadtest/gpu.sh structured

MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
STEP_TAIL=8  # lines of each step's log shown

[ -n "${SKIP_CHECK:-}" ] || gpu_step check 240 env GPU_TEST_OUT="$OUT" python3 -m pytest -q \
  -p no:cacheprovider tests/gpu/test_gpu_structured.py
gpu_step model 120 python3 loadtest/make_tokenizer.py --config "$MODEL_DIR/config.json" \
  --out "$RUN_DIR/llama8b"
gpu_step bench 420 python3 loadtest/structured_bench.py --model "$RUN_DIR/llama8b" \
  --load-format dummy --requests "${REQUESTS:-256}" --prompt-len 128 \
  --max-tokens "${MAX_TOKENS:-256}" --repeats 3 --out "$OUT/structured_8b.json"
