#!/usr/bin/env bash
# Speculative decoding on one GPU with the Llama-3.1-8B shape (dummy bf16 weights rewritten
# into a copy model, loadtest/copy_model.py: greedy decoding follows a fixed token chain with
# a wide logit gap, so acceptance is decided by the drafts and not by bf16 noise):
# loadtest/spec_bench.py measures (a) the steady-state cost of a verify step of k + 1 tokens
# against a 1-token decode step at batch 1, 8 and 32, with the forward path each took (verify
# steps replay whole-step CUDA graphs per (batch bucket, k + 1)), (b) single-stream TPOT
# without speculation and with n-gram drafts on a prompt quoting the whole answer
# (ngram_quote) and a quote corrupted every 8th token (ngram_partial), oracle drafts, and the
# target's own weights as draft model; every mode's greedy tokens are checked against the
# baseline's and the chain. With REAL_MODEL (a real model folder or .gguf), also n-gram on
# real text. Results in $OUT: spec.json, spec.md, and the logs; the summary is printed.
#
#     bash loadtest/gpu_spec.sh            # from the repository root; about 2-3 minutes
#
# Knobs (environment): K (4, num_speculative_tokens), MAX_TOKENS (256), BATCH_SIZES (1,8,32),
# REAL_MODEL (unset: skipped unless loadtest/models/smollm2 exists), MODEL_DIR, EXTRA_ARGS
# (more spec_bench.py flags; a CPU check with a tiny model: MODEL_DIR=<tiny folder>
# EXTRA_ARGS="--device cpu --num-kv-blocks 512 --max-tokens 24 --iters 3", and
# OMP_NUM_THREADS=1 on a busy CPU).
# Needs no pip install: the carried wheels of .whl/ go to /tmp/site and the repository's
# folders are linked as the package `meshserve` (as gpu_suite.sh does).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_spec_out.XXXXXX")}
RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_spec.XXXXXX")
trap 'rm -rf "$RUN_DIR"' EXIT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# shellcheck source=loadtest/gpu_env.sh
. "$REPO/loadtest/gpu_env.sh"
gpu_env "$RUN_DIR"
MODEL_DIR=${MODEL_DIR:-$REPO/loadtest/models/llama-3.1-8b}
REAL_MODEL=${REAL_MODEL:-}
if [ -z "$REAL_MODEL" ] && [ -e "$REPO/loadtest/models/smollm2" ]; then
  REAL_MODEL=$REPO/loadtest/models/smollm2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

REAL_ARGS=()
[ -n "$REAL_MODEL" ] && REAL_ARGS=(--real-model "$REAL_MODEL")
echo "== spec_bench (limit 280s)"
began=$SECONDS
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags
timeout -k 5 280 python3 loadtest/spec_bench.py --model "$MODEL_DIR" --load-format dummy \
  -k "${K:-4}" --max-tokens "${MAX_TOKENS:-256}" --batch-sizes "${BATCH_SIZES:-1,8,32}" \
  --out "$OUT/spec.json" --markdown "$OUT/spec.md" "${REAL_ARGS[@]}" ${EXTRA_ARGS:-} \
  >"$OUT/spec_bench.log" 2>&1
rc=$?
echo "== spec_bench: exit $rc in $((SECONDS - began))s"
if [ -s "$OUT/spec.md" ]; then
  cat "$OUT/spec.md"
else
  tail -40 "$OUT/spec_bench.log"
fi
exit $rc
