# Part `spec` of loadtest/gpu.sh: speculative decoding on one GPU with the Llama-3.1-8B shape (dummy bf16 weights rewritten
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
#     bash loadtest/gpu.sh spec            # about 2-3 minutes; results in $OUT/spec
#
# Knobs (environment): K (4, num_speculative_tokens), MAX_TOKENS (256), BATCH_SIZES (1,8,32),
# REAL_MODEL (unset: skipped unless loadtest/models/smollm2 exists), MODEL_DIR, EXTRA_ARGS
# (more spec_bench.py flags; a CPU check with a tiny model: MODEL_DIR=<tiny folder>
# EXTRA_ARGS="--device cpu --num-kv-blocks 512 --max-tokens 24 --iters 3", and
# OMP_NUM_THREADS=1 on a busy CPU).

MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
REAL_MODEL=${REAL_MODEL:-}
if [ -z "$REAL_MODEL" ] && [ -e "$PWD/loadtest/models/smollm2" ]; then
  REAL_MODEL=$PWD/loadtest/models/smollm2
fi

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
exit $rc  # the part's status (it runs in its own subshell)
