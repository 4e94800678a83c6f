#!/usr/bin/env bash
# The GPU driver of meshserve's benchmarks and GPU checks: `bash loadtest/gpu.sh PART...`
# from the repository root. One preamble (loadtest/gpu/env.sh: the carried wheels of .whl/
# installed to /tmp/site, the repository's folders linked as the package `meshserve` from
# pyproject.toml's package-dir, offline settings, env.txt), then each PART in order, each in
# a subshell, its files in $OUT/PART/ (OUT defaults to a new temporary folder). The parts'
# bodies are loadtest/gpu/PART.sh; their knobs are environment variables, listed at the top
# of each body and in loadtest/README.md. Most parts fit one 10-minute call on their own.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
# shellcheck source=loadtest/gpu/env.sh
. loadtest/gpu/env.sh

# The parts, with what each runs (`usage` prints this table; tests read it).
PARTS_HELP="
  suite       the engine on one GPU: kernel and engine-path GPU tests, \`meshserve bench\`
              latency, throughput (ShareGPT-like, 1024/128, 1000/1000), 8k prefill
  peer        the transformers peer (loadtest/hf_peer_bench.py) against \`meshserve bench\`
              on the same latency and throughput workloads
  mesh        \`meshserve up\` + \`meshserve bench serve\` next to the in-process engine, once
              per VARIANTS entry (--no-kvstore, default, traced, ...)
  kv          the KV tier, KV-aware routing and failover (KV_PARTS)
  lora        multi-LoRA serving in process (8 adapters against the base model)
  spec        speculative decoding: verify-step cost, n-gram / oracle / draft-model TPOT
  fp8         FP8 weights, LM head and KV cache against bf16 (FP8_RUNS: base head widen
              mesh pairs pdl)
  tp          tensor parallelism on 2 GPUs (TP=2 against TP=1, in process and meshed)
  structured  structured outputs: GPU check, then the half-json_schema batch
  metrics     vLLM-named metrics of the mesh under load, scraped around the benchmark
  profile     where a decode step's device time goes (2 GPUs; loadtest/gpu_profile.py)
  tests       the GPU correctness tests: pytest -q tests/gpu
  ab          the suite's latency, ShareGPT-like throughput and 8k prefill on a baseline
              tree (BASE_TREE) and on this tree, side by side
  vllm        vLLM's offline engine next to \`meshserve bench\` on the same prompts
              (ShareGPT-like throughput, single-stream TPOT); installs vLLM from the parts
              loadtest/vllm_fetch.sh prepares, carried over several calls
  disagg      disaggregated serving on 2 GPUs: 1 prefill + 1 decode worker against 2 mixed
              ones, long prompts at a sweep of request rates; goodput under TTFT/ITL SLOs"
PARTS=(suite peer mesh kv lora spec fp8 tp structured metrics profile tests ab vllm disagg)

usage() {
  echo "usage: bash loadtest/gpu.sh PART [PART...]   (results in \$OUT/PART/)"
  echo "parts:$PARTS_HELP"
}

(($# > 0)) || { usage; exit 2; }
for part in "$@"; do
  if [[ " ${PARTS[*]} " != *" $part "* || ! -f loadtest/gpu/$part.sh ]]; then
    echo "unknown part: $part" >&2
    usage >&2
    exit 2
  fi
done

gpu_start
echo "== results in $OUT"
rc=0
for part in "$@"; do
  echo "== part $part ($(date -u +%H:%M:%S))" | tee -a "$OUT/parts.log"
  began=$SECONDS
  (
    gpu_part_dirs "$part"
    # shellcheck source=/dev/null
    . "loadtest/gpu/$part.sh"
  )
  status=$?
  ((status == 0)) || rc=1
  echo "== part $part: exit $status in $((SECONDS - began))s" | tee -a "$OUT/parts.log"
done
exit $rc
