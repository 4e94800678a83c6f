# Part `tp` of loadtest/gpu.sh: tensor parallelism on one host with 2 GPUs. The steps' limits add up to 1145 s, more than
# one 10-minute call: run them in parts with SKIP (each part well under its limits; the
# records in loadtest/reports/tp/README.md name the parts). Steps:
#   check     tests/gpu/test_gpu_tensor_parallel.py: a tiny random model (float32) with CUDA
#             graphs and the overlapped loop, greedy tokens and logprobs at TP=2 against TP=1
#             ($OUT/tensor_parallel.json)
#   lat_tp1   `meshserve bench latency` single stream (128 in / 128 out), Llama-3.1-8B shape
#   lat_tp2   the same at --tensor-parallel-size 2   (target: TPOT <= 0.6 x lat_tp1's)
#   lat_tp2_unfused  lat_tp2 with MESHSERVE_TP_FUSED_NORM=0 (each sum over ranks, then the
#             residual add + RMSNorm: no fused kernel)
#   lat_tp2_nccl  lat_tp2 with --disable-custom-all-reduce (NCCL for every sum over ranks)
#   kernels   tests/gpu/test_gpu_kernels.py: the Triton kernels compiled on the GPU against
#             the PyTorch references ($OUT/gpu_kernels.json)
#   probe     loadtest/tp_allreduce_probe.py: all-reduce latencies inside CUDA graphs, and the
#             fused sum + add + RMSNorm against the unfused three kernels ($OUT/probe.json)
#   tput_tp2  `meshserve bench throughput --dataset sharegpt-like` (1000 prompts) at TP=2
#   tput_dp   the same prompt list shared round-robin by two TP=1 engines, one per GPU, in two
#             processes at once (--num-shards 2 --shard-index 0|1): output tokens of both over
#             the slower one's time
#   mesh_dp   `meshserve up --workers 2` (one TP=1 worker per GPU behind the router), then
#             `meshserve bench serve`: the ShareGPT-like list at once, and single-stream
#             LAT_LEN in / LAT_LEN out (loadtest/gpu/mesh_run.sh; its files in $OUT/mesh_dp/)
#   mesh_tp2  the same with one worker at --tensor-parallel-size 2 ($OUT/mesh_tp2/)
#   lat70_tp2 lat_tp2 with the Llama-3.1-70B shape: TPOT against its floor, rank 0's weight
#             bytes / measured copy bandwidth (dummy weights drawn on each GPU, per slice)
# Results in $OUT: <step>.json and <step>.log per step, steps.log, summary.md, results.json.
# Knobs: SKIP (step names), DEVICE, MODEL_8B, MODEL_70B, LAT_LEN, LAT_ITERS, SHAREGPT_PROMPTS,
# FLAGS_8B, FLAGS_70B, MESH_LIMIT_S (240, each mesh step's limit).
#
#     bash loadtest/gpu.sh tp                                   # results in $OUT/tp
#     DEVICE=cpu MODEL_8B=<tiny model> SKIP="check kernels lat70_tp2" SHAREGPT_PROMPTS=8 \
#       LAT_LEN=8 bash loadtest/gpu.sh tp          # a dry run of the commands on a CPU

DEVICE=${DEVICE:-cuda}
MODEL_8B=${MODEL_8B:-$PWD/loadtest/models/llama-3.1-8b}
MODEL_70B=${MODEL_70B:-$PWD/loadtest/models/llama-3.1-70b}
LAT_LEN=${LAT_LEN:-128}
LAT_ITERS=${LAT_ITERS:-5}
SHAREGPT_PROMPTS=${SHAREGPT_PROMPTS:-1000}
SKIP=${SKIP:-}
MESH_LIMIT_S=${MESH_LIMIT_S:-240}
FLAGS_8B=${FLAGS_8B:---load-format dummy --max-model-len 8448}
# 70B at TP=2: ~70 GB of weights per GPU. A small step budget keeps the piecewise graphs
# (and their capture time) small; single-stream decode needs no more.
FLAGS_70B=${FLAGS_70B:---load-format dummy --max-model-len 4096 --max-num-batched-tokens 512 \
--gpu-memory-utilization 0.95}
bench() {  # bench NAME LIMIT_S latency|throughput MODEL FLAGS...
  local name=$1 limit=$2 kind=$3 model=$4
  shift 4
  gpu_step "$name" "$limit" python3 -m "$MESHSERVE_CLI" bench "$kind" --model "$model" \
    --device "$DEVICE" --no-progress --output-json "$OUT/$name.json" "$@"
}

# ---- the correctness checks (CUDA graphs and NCCL inside them; tests/gpu) -------------------
gpu_step check 75 env GPU_TEST_OUT="$OUT" python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_gpu_tensor_parallel.py
gpu_step kernels 150 env GPU_TEST_OUT="$OUT" python3 -m pytest -q -p no:cacheprovider \
  tests/gpu/test_gpu_kernels.py
gpu_step probe 120 python3 loadtest/tp_allreduce_probe.py --out "$OUT/probe.json"

# ---- single-stream decode: TP=1 and TP=2 ------------------------------------------------------
# shellcheck disable=SC2086  # FLAGS_* are lists of flags
LATENCY=(--input-len "$LAT_LEN" --output-len "$LAT_LEN" --batch-size 1 --num-iters "$LAT_ITERS"
         --num-iters-warmup 2 --max-num-seqs 1)
# shellcheck disable=SC2086
bench lat_tp1 60 latency "$MODEL_8B" "${LATENCY[@]}" $FLAGS_8B
# shellcheck disable=SC2086
bench lat_tp2 75 latency "$MODEL_8B" "${LATENCY[@]}" $FLAGS_8B --tensor-parallel-size 2
# The same without the fused sum + add + RMSNorm kernel
# shellcheck disable=SC2086
gpu_step lat_tp2_unfused 75 env MESHSERVE_TP_FUSED_NORM=0 python3 -m "$MESHSERVE_CLI" \
  bench latency --model "$MODEL_8B" --device "$DEVICE" --no-progress \
  --output-json "$OUT/lat_tp2_unfused.json" "${LATENCY[@]}" $FLAGS_8B --tensor-parallel-size 2
# The same with NCCL's all-reduce for every sum (no one-shot all-reduce over symmetric memory)
# shellcheck disable=SC2086
bench lat_tp2_nccl 75 latency "$MODEL_8B" "${LATENCY[@]}" $FLAGS_8B --tensor-parallel-size 2 \
  --disable-custom-all-reduce

# ---- ShareGPT-like throughput: one TP=2 engine, and two TP=1 engines side by side ----------
THROUGHPUT=(--dataset sharegpt-like --num-prompts "$SHAREGPT_PROMPTS" --num-iters-warmup 1)
# shellcheck disable=SC2086
bench tput_tp2 90 throughput "$MODEL_8B" "${THROUGHPUT[@]}" $FLAGS_8B --tensor-parallel-size 2
cat >"$RUN_DIR/pair.sh" <<SH
#!/usr/bin/env bash
# Two TP=1 engines at once, one per GPU, each running every other prompt of the same list.
pids=()
for i in 0 1; do
  # Each engine sees its own GPU as cuda:0, as a worker started on that GPU alone would.
  visible=\${CUDA_VISIBLE_DEVICES:-}
  [ "$DEVICE" = cuda ] && visible=\$i
  CUDA_VISIBLE_DEVICES=\$visible python3 -m "$MESHSERVE_CLI" bench throughput \
    --model "$MODEL_8B" --device "$DEVICE" \
    --no-progress --output-json "$OUT/tput_dp\$i.json" ${THROUGHPUT[*]} $FLAGS_8B \
    --num-shards 2 --shard-index \$i &
  pids+=(\$!)
done
rc=0
for pid in "\${pids[@]}"; do wait "\$pid" || rc=1; done
exit \$rc
SH
gpu_step tput_dp 90 bash "$RUN_DIR/pair.sh"

# ---- the same through the mesh: one TP=2 worker, and two TP=1 workers behind the router ----
# `meshserve up` on the 8B shape with a tokenizer of its vocabulary; `meshserve bench serve`
# sends the ShareGPT-like list at once, then LAT_LEN in / LAT_LEN out one stream at a time.
MESH_MODEL=$RUN_DIR/mesh8b
gpu_step mesh_model 60 python3 loadtest/make_tokenizer.py --config "$MODEL_8B/config.json" \
  --out "$MESH_MODEL"
for mesh in mesh_dp mesh_tp2; do
  placement=(--workers 2)
  [ "$mesh" = mesh_tp2 ] && placement=(--tensor-parallel-size 2)
  # shellcheck disable=SC2086
  gpu_step "$mesh" "$MESH_LIMIT_S" env SWEEP=" " PYSPY_S=0 SHAREGPT_PROMPTS="$SHAREGPT_PROMPTS" \
    LATENCY_LEN="$LAT_LEN" LATENCY_PROMPTS=4 bash loadtest/gpu/mesh_run.sh "$MESH_MODEL" \
    "$OUT/$mesh" --device "$DEVICE" "${placement[@]}" $FLAGS_8B
done

# ---- the 70B shape at TP=2 (last: the most likely to run out of memory on 80 GB cards) ------
# shellcheck disable=SC2086
bench lat70_tp2 140 latency "$MODEL_70B" "${LATENCY[@]}" $FLAGS_70B --tensor-parallel-size 2

# ---- summary -------------------------------------------------------------------------------
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])

def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None

def ms(seconds):
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"

def times(x):
    return "n/a" if x is None else f"{x:.2f} x"

def tpot(result):
    return result["tpot_s"]["avg"] if result and result.get("tpot_s") else None

r = {n: load(n) for n in ("tensor_parallel", "lat_tp1", "lat_tp2", "lat_tp2_unfused", "lat_tp2_nccl",
                          "lat70_tp2", "tput_tp2", "tput_dp0", "tput_dp1", "probe")}
rows = ["| figure | value | note |", "|---|---|---|"]
check = r["tensor_parallel"]
if check:
    rows.append(f"| TP=2 vs TP=1, tiny model fp32 | {check['identical_tokens']}/"
                f"{check['requests']} requests identical | max logprob diff "
                f"{check['max_logprob_diff']:.2e}; CUDA graphs {check['cuda_graphs']} |")
lat1, lat2, lat70 = r["lat_tp1"], r["lat_tp2"], r["lat70_tp2"]
t1, t2, t70 = tpot(lat1), tpot(lat2), tpot(lat70)
floor = lambda x: x["floor_s_per_token"] if x else None  # noqa: E731
rows.append(f"| 8B single-stream TPOT, TP=1 | {ms(t1)} | floor {ms(floor(lat1))} |")
rows.append(f"| 8B single-stream TPOT, TP=2 | {ms(t2)} | "
            f"{times(t2 / t1 if t1 and t2 else None)} TP=1 (target <= 0.60); per-rank floor "
            f"{ms(floor(lat2))} |")
t2u = tpot(r["lat_tp2_unfused"])
if t2u:
    rows.append(f"| 8B single-stream TPOT, TP=2, no fused sum + RMSNorm | {ms(t2u)} | "
                f"{times(t2u / t1 if t1 else None)} TP=1 (MESHSERVE_TP_FUSED_NORM=0) |")
fused = (r["probe"] or {}).get("sum_add_rms_norm") or {}
for key, row in fused.items():
    if key.startswith("tokens_") and "fused_us" in row:
        rows.append(f"| sum + add + RMSNorm of {key[7:]} rows of 4096, in CUDA graphs | "
                    f"fused {row['fused_us']:.1f} us, unfused {row['unfused_us']:.1f} us | "
                    f"max difference {row['max_diff_normed']:.3g} (normed), "
                    f"{row['max_diff_residual']:.3g} (residual) |")
t2n = tpot(r["lat_tp2_nccl"])
if t2n:
    rows.append(f"| 8B single-stream TPOT, TP=2, NCCL sums only | {ms(t2n)} | "
                f"{times(t2n / t1 if t1 else None)} TP=1 (--disable-custom-all-reduce) |")
if lat70:
    rows.append(f"| 70B single-stream TPOT, TP=2 | {ms(t70)} | "
                f"{times(lat70['tpot_over_floor'])} the per-rank floor {ms(floor(lat70))} "
                f"({lat70['weight_bytes'] / 1e9:.1f} GB on rank 0 / "
                f"{lat70['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s copy) |")
tp2, pair = r["tput_tp2"], [r["tput_dp0"], r["tput_dp1"]]
if tp2:
    rows.append(f"| ShareGPT-like, one TP=2 engine | {tp2['output_tokens_per_s']:.0f} output "
                f"tok/s | {tp2['num_requests']} requests |")
if all(pair):
    tokens = sum(p["output_tokens"] for p in pair)
    slowest = max(p["elapsed_s"] for p in pair)
    rows.append(f"| ShareGPT-like, two TP=1 engines | {tokens / slowest:.0f} output tok/s | "
                f"in-process, one per GPU in two processes, the prompt list round-robin "
                f"(output tokens of both / the slower one's time) |")
for mesh, what in (("mesh_dp", "two TP=1 workers behind the router"),
                   ("mesh_tp2", "one TP=2 worker")):
    burst, single = (out / mesh / "mesh_sharegpt.json", out / mesh / "mesh_latency.json")
    if burst.is_file():
        b = json.loads(burst.read_text())
        r[f"{mesh}_sharegpt"] = b
        rows.append(f"| ShareGPT-like through the mesh, {what} | {b['output_throughput']:.0f} "
                    f"output tok/s | `meshserve up` + `meshserve bench serve`, "
                    f"{b['completed']} done, {b['failed']} failed |")
    if single.is_file():
        s = json.loads(single.read_text())
        r[f"{mesh}_latency"] = s
        rows.append(f"| single-stream TPOT through the mesh, {what} | "
                    f"{s['mean_tpot_ms']:.2f} ms | {s['completed']} streams |")
gpu = next((x["environment"].get("gpu_name") for x in r.values() if x and "environment" in x), None)
table = f"GPU: {gpu}\n\n" + "\n".join(rows) + "\n"
(out / "summary.md").write_text(table)
(out / "results.json").write_text(json.dumps(r, indent=2, default=str))
print(table)
PY
