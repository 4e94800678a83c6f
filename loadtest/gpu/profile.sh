# Part `profile` of loadtest/gpu.sh: where a single-stream decode step's device time goes, and the per-shape product times, on a
# host with 2 GPUs (two single-GPU jobs run at once, one per GPU; a TP=2 profile after them):
#     bash loadtest/gpu.sh profile      # results in $OUT/profile
#     PROFILES="bf16:0:{} fp8:1:{\"quantization\":\"fp8\"}" KERNELS="tp1:1,8" \
#       bash loadtest/gpu.sh profile
# PROFILES: NAME:GPUS:ENGINE_JSON entries, each `loadtest/gpu_profile.py --parts graphs`
# (plus host phases) on the Llama-3.1-8B shape; entries on one GPU run two at a time.
# KERNELS: SHAPES:ROWS entries, each `loadtest/fp8_kernels_bench.py` (CUDA-graph times).
# PROFILE_PARTS: gpu_profile.py's --parts (graphs,host). MODEL: the model config folder.
MODEL=${MODEL:-$PWD/loadtest/models/llama-3.1-8b}
PROFILES=${PROFILES:-'bf16:0:{} fp8:1:{"quantization":"fp8"} tp2:0,1:{"tensor_parallel_size":2}'}
KERNELS=${KERNELS:-}
PROFILE_PARTS=${PROFILE_PARTS:-graphs,host}
kernels() {  # kernels SHAPES ROWS GPU
  CUDA_VISIBLE_DEVICES=$3 timeout -k 10 300 python3 loadtest/fp8_kernels_bench.py \
    --shapes "$1" --rows ${2//,/ } --out "$OUT/kernels_$1.json" >"$OUT/kernels_$1.log" 2>&1
  echo "== kernels $1 exit $?"
}
prof() {  # prof NAME GPUS ENGINE_JSON
  CUDA_VISIBLE_DEVICES=$2 timeout -k 10 300 python3 loadtest/gpu_profile.py --model "$MODEL" \
    --parts "$PROFILE_PARTS" --engine "$3" --out "$OUT/$1" >"$OUT/$1.log" 2>&1
  echo "== $1 exit $?"
}
gpu=0
for entry in $KERNELS; do
  kernels "${entry%%:*}" "${entry#*:}" $gpu &
  gpu=$((1 - gpu))
done
wait
pending=0
for entry in $PROFILES; do
  name=${entry%%:*} rest=${entry#*:}
  gpus=${rest%%:*} json=${rest#*:}
  if [[ $gpus == *,* ]]; then wait; pending=0; prof "$name" "$gpus" "$json"; continue; fi
  prof "$name" "$gpus" "$json" &
  pending=$((pending + 1))
  if ((pending == 2)); then wait; pending=0; fi
done
wait
{
  for entry in $KERNELS; do
    echo "######## kernels ${entry%%:*}"
    cat "$OUT/kernels_${entry%%:*}.md" 2>/dev/null || tail -20 "$OUT/kernels_${entry%%:*}.log"
  done
  for entry in $PROFILES; do
    name=${entry%%:*}
    echo "######## $name"
    cat "$OUT/$name/profile.txt" 2>/dev/null || tail -30 "$OUT/$name.log"
  done
} >"$OUT/summary.txt"
grep -v "^void at::native\|^Memcpy" "$OUT/summary.txt" | head -c 11500
