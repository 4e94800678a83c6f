#!/usr/bin/env bash
# ShareGPT-like throughput (800 requests at once) with the LM head's rows padded (the
# default, services/worker/models/llama.py `compute_logits`) and without (the padding
# switched off in the process), FP8 weights + FP8 KV cache and bf16, one after the other
# on one GPU, in one call of at most 10 minutes (about 60 s a run):
#     bash loadtest/gpu_logit_padding.sh       # from the repository root; results in $OUT
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
# shellcheck source=loadtest/gpu_env.sh
. "$REPO/loadtest/gpu_env.sh"
gpu_script_start
MODEL=${MODEL:-$REPO/loadtest/models/llama-3.1-8b}
RUNS=${RUNS:-fp8kv8_pad fp8kv8_nopad bf16_pad bf16_nopad}
for name in $RUNS; do
  flags=() pad=1
  [[ $name == fp8kv8_* ]] && flags=(--quantization fp8 --kv-cache-dtype fp8)
  [[ $name == *_nopad ]] && pad=0
  timeout 150 python3 - "$name" "$pad" "$OUT" "$MODEL" "${flags[@]}" >"$OUT/$name.log" 2>&1 <<'PY'
import runpy
import sys

import meshserve.services.worker.models.llama as llama

name, pad, out, model, *flags = sys.argv[1:]
if pad == "0":  # every row count as it comes
    llama.padded_logit_rows = lambda rows: rows
sys.argv = ["fp8_bench.py", "run", "--label", name, "--out", f"{out}/{name}.json",
            "--num-prompts", "800", "--logprob-prompts", "1", "--", "--model", model,
            "--load-format", "dummy", "--max-model-len", "4096", *flags]
runpy.run_path("loadtest/fp8_bench.py", run_name="__main__")
PY
  echo "== $name: exit $? $(tail -1 "$OUT/$name.log")"
done
