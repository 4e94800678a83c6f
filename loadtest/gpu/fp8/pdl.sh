# FP8_RUNS entry `pdl` of part `fp8` (loadtest/gpu/fp8.sh; results in $OUT/fp8/pdl):
# Programmatic dependent launch (kernels/pdl.py) off and on, on a host with 2 GPUs, in one
# call of at most 10 minutes:
#   1. single-stream latency (128 in / 128 out) of the Llama-3.1-8B shape (dummy weights) at
#      MESHSERVE_PDL=0, 1 and 2: bf16 on GPU 0 and FP8 (--quantization fp8) on GPU 1 at the
#      same time; each run also scores fixed prompts, so runs of one precision compare
#      logprob for logprob (PDL must not change a bit)
#   2. (TPUT_MODES, default "1") ShareGPT-like throughput (NUM_PROMPTS) of bf16 and FP8 at
#      those modes, bf16 and FP8 at once on the two GPUs
# Results in $OUT: lat_<precision>_pdl<M>.json, tput_<precision>_pdl<M>.json, their logs,
# summary.md (loadtest/fp8_bench.py's tables: each precision's PDL modes against PDL 0,
# and FP8 against bf16 at each mode).
#
#     FP8_RUNS=pdl bash loadtest/gpu.sh fp8
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
MODES=${MODES:-0 1 2}
TPUT_MODES=${TPUT_MODES:-1}
NUM_PROMPTS=${NUM_PROMPTS:-800}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}

one() {  # one NAME GPU PDL_MODE PROMPTS EXTRA_FLAGS...: one fp8_bench.py run
  local name=$1 gpu=$2 mode=$3 prompts=$4
  shift 4
  CUDA_VISIBLE_DEVICES=$gpu MESHSERVE_PDL=$mode timeout -k 5 170 python3 loadtest/fp8_bench.py \
    run --label "$name" --out "$OUT/$name.json" --num-prompts "$prompts" -- \
    --model "$MODEL_DIR" --load-format dummy --max-model-len "$MAX_MODEL_LEN" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name (GPU $gpu, MESHSERVE_PDL=$mode): rc=$?" | tee -a "$OUT/steps.log"
}
pair() {  # pair KIND PDL_MODE PROMPTS: bf16 on GPU 0 and FP8 on GPU 1 at once
  one "$1_bf16_pdl$2" 0 "$2" "$3" &
  one "$1_fp8_pdl$2" 1 "$2" "$3" --quantization fp8 &
  wait
}
for mode in $MODES; do pair lat "$mode" 0; done
for mode in $TPUT_MODES; do pair tput "$mode" "$NUM_PROMPTS"; done

: >"$OUT/summary.md"
for precision in bf16 fp8; do
  fp8_report "$precision: PDL 1 and 2 against PDL 0 (same precision)" \
    "lat_${precision}_pdl0" "lat_${precision}_pdl1" "lat_${precision}_pdl2"
done
for mode in 0 1 2; do
  fp8_report "FP8 against bf16 at PDL $mode, latency runs" "lat_bf16_pdl$mode" "lat_fp8_pdl$mode"
  fp8_report "FP8 against bf16 at PDL $mode, throughput runs" "tput_bf16_pdl$mode" \
    "tput_fp8_pdl$mode"
done
cat "$OUT/summary.md"
