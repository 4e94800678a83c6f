#!/usr/bin/env bash
# Structured outputs on one GPU: correctness of the overlapped loop's constrained steps and
# of the masking kernel (loadtest/gpu_structured_check.py), then the half-json_schema
# batch against the free batch and compile times (loadtest/structured_bench.py) with the
# Llama-3.1-8B shape (dummy bf16 weights, a tokenizer of its vocabulary made by
# loadtest/make_tokenizer.py). Results in $OUT.
#
#     bash loadtest/gpu_structured.sh
#
# Needs no pip install: the carried wheels of .whl/ go to /tmp/site and the repository's
# folders are linked as the package `meshserve` (as gpu_suite.sh does).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_structured_out.XXXXXX")}
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_structured.XXXXXX")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck source=loadtest/gpu_env.sh
. "$REPO/loadtest/gpu_env.sh"
gpu_env "$RUN_DIR"
MODEL_DIR=${MODEL_DIR:-$REPO/loadtest/models/llama-3.1-8b}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1

STEP_TAIL=8  # lines of each step's log shown

[ -n "${SKIP_CHECK:-}" ] || gpu_step check 240 python3 loadtest/gpu_structured_check.py --out "$OUT/check.json"
gpu_step model 120 python3 loadtest/make_tokenizer.py --config "$MODEL_DIR/config.json" \
  --out "$RUN_DIR/llama8b"
gpu_step bench 420 python3 loadtest/structured_bench.py --model "$RUN_DIR/llama8b" \
  --load-format dummy --requests "${REQUESTS:-256}" --prompt-len 128 \
  --max-tokens "${MAX_TOKENS:-256}" --repeats 3 --out "$OUT/structured_8b.json"
