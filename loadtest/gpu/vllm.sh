# Part `vllm` of loadtest/gpu.sh: vLLM's offline engine next to `meshserve bench` on the same
# token prompts, one after the other on the same GPUs in one call (DESIGN.md, decision 14).
# vLLM travels as what loadtest/vllm_fetch.sh prepares in .vllm/ (it prints the calls and what
# each carries): every call stashes what it carries in VLLM_STORE, outside the tree; the call
# that completes the set joins, checks and installs it into VLLM_STORE/site
# (loadtest/gpu/vllm_install.sh), which only vLLM's process puts on its PYTHONPATH. Then,
# unless VLLM_BENCH=0, each step within VLLM_BUDGET_S seconds of the driver's start:
#   vllm_check   the modules of vLLM's offline path import (loadtest/vllm_offline.py check)
#   ms_sharegpt  `meshserve bench throughput --dataset sharegpt-like`, VLLM_PROMPTS requests
#                after a warm-up batch of WARMUP_PROMPTS, its prompts saved (--save-prompts)
#   ms_latency   `meshserve bench latency`, LATENCY_LEN in and out, batch 1, prompts saved
#   vllm         loadtest/vllm_offline.py run on both prompt files: vLLM's start, its
#                throughput (same warm-up) and its single-stream latency
#   report       summary.json and summary.md: the two side by side, ratios meshserve / vLLM
# Both engines run dummy weights, context MAX_MODEL_LEN, GPU_MEMORY_UTILIZATION (meshserve's
# default; vLLM's LLM would take 0.92) and seed SEED.
#
# Writes in $OUT/vllm/: steps.log, <step>.log, ms_sharegpt.json, ms_latency.json, vllm.json,
# summary.json, summary.md. The part fails (exit 1) when VLLM_BENCH is on and no summary came.
#
# Knobs: MODEL_DIR (a model folder, default loadtest/models/llama-3.1-8b), VLLM_PROMPTS (1000),
# WARMUP_PROMPTS (VLLM_PROMPTS), MAX_MODEL_LEN (8448, the suite's), GPU_MEMORY_UTILIZATION
# (0.9), LATENCY_LEN (128), LATENCY_ITERS (5), LATENCY_WARMUP (2), SEED (0), ENGINE_FLAGS (more
# `meshserve bench` flags, e.g. "--tensor-parallel-size 2"), VLLM_FLAGS (a JSON object of more
# LLM(...) keywords, e.g. '{"tensor_parallel_size": 2, "enable_expert_parallel": true}'),
# VLLM_ATTENTION (FLASH_ATTN; auto: vLLM chooses), VLLM_STORE (/root/vllm-store), VLLM_BENCH
# (1), VLLM_CARRIED (.vllm: where the carried parts are), VLLM_CHECK_MODULES (comma-separated;
# default: vllm_offline.py's list), VLLM_BUDGET_S
# (570), limits T_INSTALL (300), T_CHECK (120), T_SHAREGPT (180), T_LATENCY (120), T_VLLM (360).
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
VLLM_PROMPTS=${VLLM_PROMPTS:-1000}
WARMUP_PROMPTS=${WARMUP_PROMPTS:-$VLLM_PROMPTS}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8448}
GPU_MEMORY_UTILIZATION=${GPU_MEMORY_UTILIZATION:-0.9}
LATENCY_LEN=${LATENCY_LEN:-128}
LATENCY_ITERS=${LATENCY_ITERS:-5}
LATENCY_WARMUP=${LATENCY_WARMUP:-2}
SEED=${SEED:-0}
ENGINE_FLAGS=${ENGINE_FLAGS:-}
VLLM_FLAGS=${VLLM_FLAGS:-"{}"}
VLLM_STORE=${VLLM_STORE:-/root/vllm-store}
INSTALLER=loadtest/gpu/vllm_install.sh

vllm_step() {  # vllm_step NAME LIMIT_S COMMAND...: gpu_step within the part's budget
  local name=$1 limit=$2 left=$((${VLLM_BUDGET_S:-570} - SECONDS))
  shift 2
  if ((left < 30)); then
    echo "== $name: skipped (${left}s of VLLM_BUDGET_S left)" | tee -a "$OUT/steps.log"
    return 1
  fi
  ((limit > left)) && limit=$left
  gpu_step "$name" "$limit" "$@"
}

vllm_bench() {  # the benchmarks, in order; stops where a later step would have no input
  local site_path=$VLLM_STORE/site${PYTHONPATH:+:$PYTHONPATH} inputs=()
  local common=(--model "$MODEL_DIR" --load-format dummy --max-model-len "$MAX_MODEL_LEN"
    --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" --seed "$SEED" --no-progress)
  vllm_step vllm_check "${T_CHECK:-120}" env PYTHONPATH="$site_path" python3 \
    loadtest/vllm_offline.py check ${VLLM_CHECK_MODULES:+--modules "$VLLM_CHECK_MODULES"} ||
    return 1
  # shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
  vllm_step ms_sharegpt "${T_SHAREGPT:-180}" python3 -m "$MESHSERVE_CLI" bench throughput \
    "${common[@]}" $ENGINE_FLAGS --dataset sharegpt-like --num-prompts "$VLLM_PROMPTS" \
    --num-iters-warmup 1 --warmup-prompts "$WARMUP_PROMPTS" \
    --save-prompts "$RUN_DIR/sharegpt.jsonl" --output-json "$OUT/ms_sharegpt.json"
  # shellcheck disable=SC2086
  vllm_step ms_latency "${T_LATENCY:-120}" python3 -m "$MESHSERVE_CLI" bench latency \
    "${common[@]}" $ENGINE_FLAGS --input-len "$LATENCY_LEN" --output-len "$LATENCY_LEN" \
    --batch-size 1 --num-iters "$LATENCY_ITERS" --num-iters-warmup "$LATENCY_WARMUP" \
    --max-num-seqs 1 --save-prompts "$RUN_DIR/latency.jsonl" \
    --output-json "$OUT/ms_latency.json"
  [ -s "$RUN_DIR/sharegpt.jsonl" ] && inputs+=(--throughput-prompts "$RUN_DIR/sharegpt.jsonl"
    --num-iters-warmup 1 --warmup-prompts "$WARMUP_PROMPTS")
  [ -s "$RUN_DIR/latency.jsonl" ] && inputs+=(--latency-prompts "$RUN_DIR/latency.jsonl"
    --latency-warmup "$LATENCY_WARMUP")
  if ((${#inputs[@]} == 0)); then
    echo "!! meshserve saved no prompts: vLLM has nothing to run" | tee -a "$OUT/steps.log"
    return 1
  fi
  vllm_step vllm "${T_VLLM:-360}" env PYTHONPATH="$site_path" python3 loadtest/vllm_offline.py \
    run --model "$MODEL_DIR" "${inputs[@]}" --max-model-len "$MAX_MODEL_LEN" \
    --gpu-memory-utilization "$GPU_MEMORY_UTILIZATION" --seed "$SEED" \
    --attention-backend "${VLLM_ATTENTION:-FLASH_ATTN}" --llm-kwargs "$VLLM_FLAGS" \
    --output-json "$OUT/vllm.json"
  [ -f "$OUT/vllm.json" ] || return 1
  STEP_TAIL=20 gpu_step report 60 python3 loadtest/vllm_offline.py report \
    --vllm "$OUT/vllm.json" --meshserve-throughput "$OUT/ms_sharegpt.json" \
    --meshserve-latency "$OUT/ms_latency.json" --out-json "$OUT/summary.json" \
    --out-md "$OUT/summary.md"
}

bash "$INSTALLER" stash "${VLLM_CARRIED:-.vllm}" "$VLLM_STORE" 2>&1 | tee -a "$OUT/steps.log"
if bash "$INSTALLER" status "$VLLM_STORE" 2>&1 | tee -a "$OUT/steps.log"; then
  bash "$INSTALLER" installed "$VLLM_STORE" ||
    vllm_step vllm_install "${T_INSTALL:-300}" bash "$INSTALLER" install "$VLLM_STORE"
else
  echo "== vLLM incomplete: carry the rest (loadtest/vllm_fetch.sh prints the calls)" |
    tee -a "$OUT/steps.log"
fi
if [ "${VLLM_BENCH:-1}" = 0 ]; then
  echo "== VLLM_BENCH=0: no benchmarks" | tee -a "$OUT/steps.log"
elif bash "$INSTALLER" installed "$VLLM_STORE"; then
  vllm_bench
else
  echo "!! vLLM is not installed in $VLLM_STORE/site: no benchmarks" | tee -a "$OUT/steps.log"
fi
[ "${VLLM_BENCH:-1}" = 0 ] || [ -f "$OUT/summary.json" ]
