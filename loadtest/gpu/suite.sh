# Part `suite` of loadtest/gpu.sh (sourced in its subshell; `peer` and `mesh` source it too
# with SUITE_SECTIONS set): the engine on one GPU in one call of at most 10 minutes, a
# Llama-3.1-8B-shaped model with dummy weights. SUITE_SECTIONS (space-separated; the part
# `suite` runs "engine"):
#   engine  the GPU tests of the kernels and engine paths (tests/gpu), `meshserve bench`
#           latency (overlapped loop on and off), throughput (ShareGPT-like, fixed 1024/128,
#           fixed 1000/1000) and an 8k-token prefill
#   peer    the transformers peer (loadtest/hf_peer_bench.py) on latency and one throughput
#           workload, next to `meshserve bench` on the same ones
#   mesh    the same prompts through `meshserve up` + `meshserve bench serve`
#           (loadtest/gpu/mesh_run.sh) next to the in-process engine (loadtest/mesh_report.py)
# Every step runs under `timeout` within a total budget (SUITE_BUDGET_S): a step that cannot
# get its minimum is skipped, and the table says so. Ends by printing a markdown table of the
# figures against DESIGN.md's budgets.
#
# What comes back in $OUT (at most a handful of files, so that all of them can be fetched):
#   suite.log       every step's command, stdout and stderr, in order, written as it goes
#   results.json    every step's status and JSON result, rewritten after each step
#   kernels.json    the kernel micro-benchmarks (kernels/bench_kernels.py --out)
#   steps.tar.gz    each step's own <step>.log and <step>.json
#   mesh_gG.tar.xz  (mesh) mesh_run.sh's files of the run with --gateways G
#   summary.md      the final table
#   mesh_summary_gG.md (mesh) the mesh with --gateways G against the in-process engine
#
# Knobs (environment): MESH_GATEWAYS ("1 2"), SUITE_BUDGET_S (570), PEAK_TFLOPS (989: H100 SXM
# dense bf16; 989 also for an H200), MODEL_DIR (a model folder to use instead of the
# Llama-3.1-8B-shaped config), ENGINE_FLAGS, MESH_FLAGS (more `meshserve up` flags for the
# mesh runs only, e.g. --no-kvstore), prompt counts SHAREGPT_PROMPTS (1000), SHORT_PROMPTS
# (500, 1024 in/128 out), LONG_PROMPTS (256, 1000/1000), HF_PROMPTS (128, 1024/128),
# HF_BATCH_SIZES, HF_FLAGS, lengths LATENCY_LEN (128), PREFILL_LEN (8192), SHORT_IN/SHORT_OUT,
# LONG_IN/LONG_OUT, iterations LATENCY_ITERS (5), PREFILL_ITERS (3), RUN_KERNEL_BENCH (set:
# also kernels/bench_kernels.py), and each step's limit T_<STEP> in seconds.

START=$SECONDS
SUITE_SECTIONS=${SUITE_SECTIONS:-engine}
RUN_DIR=$(mktemp -d "$RUN_DIR/suite.XXXXXX")
: >"$OUT/suite.log"
: >"$RUN_DIR/steps.tsv"
export OUT RUN_DIR PEAK_TFLOPS=${PEAK_TFLOPS:-989}

BUDGET_S=${SUITE_BUDGET_S:-570}
MESH_GATEWAYS=${MESH_GATEWAYS:-1 2}
want() { [[ " $SUITE_SECTIONS " == *" $1 "* ]]; }
SHAREGPT_PROMPTS=${SHAREGPT_PROMPTS:-1000}
SHORT_PROMPTS=${SHORT_PROMPTS:-500}
SHORT_IN=${SHORT_IN:-1024}
SHORT_OUT=${SHORT_OUT:-128}
LONG_PROMPTS=${LONG_PROMPTS:-256}
LONG_IN=${LONG_IN:-1000}
LONG_OUT=${LONG_OUT:-1000}
HF_PROMPTS=${HF_PROMPTS:-128}
HF_BATCH_SIZES=${HF_BATCH_SIZES:-128,64,32,16,8}
HF_FLAGS=${HF_FLAGS:---no-compile}
LATENCY_LEN=${LATENCY_LEN:-128}
LATENCY_ITERS=${LATENCY_ITERS:-5}
PREFILL_LEN=${PREFILL_LEN:-8192}
PREFILL_ITERS=${PREFILL_ITERS:-3}
# The context is capped just above the longest request of the suite (the 8k prefill), as
# vLLM's benchmarks do with --max-model-len; the KV cache is sized from memory regardless.
ENGINE_FLAGS=${ENGINE_FLAGS:---load-format dummy --max-model-len $((PREFILL_LEN + 256))}

log() { echo "$*" | tee -a "$OUT/suite.log"; }

# ---- 1. the model: a Llama-3.1-8B-shaped config.json (weights are dummy) -----------------
MODEL_DIR=${MODEL_DIR:-$REPO/loadtest/models/llama-3.1-8b}  # config.json only

# ---- 2. the steps ----------------------------------------------------------------------------
# step NAME LIMIT_S MIN_S COMMAND...: run COMMAND under `timeout` (at most LIMIT_S, and never
# past the suite's budget), or skip it when less than MIN_S is left.
step() {
  local name=$1 limit=$2 min=$3
  shift 3
  local left=$((BUDGET_S - (SECONDS - START)))
  if ((left < min)); then
    log "== $name: skipped (${left}s left, needs ${min}s)"
    printf '%s\tskipped\t0\n' "$name" >>"$RUN_DIR/steps.tsv"
    return
  fi
  ((limit > left)) && limit=$left
  local began=$SECONDS status
  log "== $name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" >"$RUN_DIR/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status="failed rc=$rc" ;;
  esac
  cat "$RUN_DIR/$name.log" >>"$OUT/suite.log"
  log "== $name: $status in $((SECONDS - began))s"
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - began))" >>"$RUN_DIR/steps.tsv"
  python3 "$RUN_DIR/report.py" merge || log "!! merging results failed"
}

bench() {  # bench NAME LIMIT MIN latency|throughput FLAGS...: `meshserve bench` on the model
  local name=$1 limit=$2 min=$3
  shift 3
  # shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
  step "$name" "$limit" "$min" python3 -m "$MESHSERVE_CLI" bench "$@" --model "$MODEL_DIR" \
    $ENGINE_FLAGS --no-progress --output-json "$RUN_DIR/$name.json"
}

hf_peer() {  # hf_peer NAME LIMIT MIN latency|throughput FLAGS...
  local name=$1 limit=$2 min=$3
  shift 3
  # shellcheck disable=SC2086  # HF_FLAGS is a list of flags
  step "$name" "$limit" "$min" python3 loadtest/hf_peer_bench.py "$@" --model "$MODEL_DIR" \
    $HF_FLAGS --no-progress --output-json "$RUN_DIR/$name.json"
}

cat >"$RUN_DIR/report.py" <<'PY'
"""Merge the steps' results into $OUT/results.json; with `table`, print the final table."""
import json, os, sys
from pathlib import Path

run, out, peak = Path(os.environ["RUN_DIR"]), Path(os.environ["OUT"]), float(os.environ["PEAK_TFLOPS"])
steps = [line.split("\t") for line in (run / "steps.tsv").read_text().splitlines() if line]
results = {"steps": [{"name": n, "status": s, "seconds": int(t)} for n, s, t in steps]}
for name, _, _ in steps:
    path = out / "kernels.json" if name == "kernels" else run / f"{name}.json"
    if path.is_file():
        results[name] = json.loads(path.read_text())
(out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
if sys.argv[1:] != ["table"]:
    sys.exit(0)

def ms(seconds): return f"{seconds * 1e3:.2f} ms"

def figures(name, r):
    """(figures, budget check) of one step."""
    log = run / f"{name}.log"
    if name in ("kernel_check", "correctness") and log.is_file():
        lines = [l for l in log.read_text().splitlines() if " passed" in l]
        return (lines[-1] if lines else ""), ""
    if r is None:
        return "", ""
    if name == "kernels":
        return f"{len(r.get('results', []))} cases on {r.get('device')}", ""
    if name.startswith("mesh_report"):
        ratio = r.get("throughput_ratio")
        text = "see mesh_summary.md" + (f"; mesh/in-process output tok/s {ratio:.3f}"
                                        if ratio is not None else "")
        return text, ""
    if r.get("benchmark") == "latency" and r["tpot_s"] is None:  # the prefill
        p = r["prefill"]
        tflops = p["flops_per_s"] / 1e12
        check = f"{100 * tflops / peak:.1f}% of {peak:g} TFLOP/s (budget >= 60%)"
        return f"{p['tokens']} tokens in {ms(p['seconds'])}: {tflops:.3g} TFLOP/s", check
    if r.get("benchmark") == "latency":
        t, f = r["tpot_s"], r["floor_s_per_token"]
        text = (f"TPOT {ms(t['avg'])} (p99 {ms(t['p99'])}), TTFT {ms(r['ttft_s']['avg'])}, "
                f"e2e {ms(r['latency_s']['avg'])}; floor {ms(f)} "
                f"({r.get('read_bytes', r['weight_bytes']) / 1e9:.2f} GB / "
                f"{r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)")
        check = f"TPOT = {r['tpot_over_floor']:.2f}x floor"
        return text, check + (" (budget <= 1.15)" if r["backend"] == "meshserve" else "")
    text = (f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.0f} output tok/s, "
            f"{r['total_tokens_per_s']:.0f} total tok/s; {r['num_requests']} requests in "
            f"{r['elapsed_s']:.1f}s")
    if r.get("num_preemptions") is not None:
        text += f", {r['num_preemptions']} preemptions"
    if r.get("batch_size"):
        text += f", batch {r['batch_size']}"
    check = ""
    if name == "sharegpt":
        check = f"{r['output_tokens_per_s'] / 8475:.2f}x vLLM's 8,475 output tok/s"
    return text, check

def versus(results):
    """meshserve against the transformers peer, where both ran."""
    lat, hf_lat = results.get("latency"), results.get("hf_latency")
    tput, hf_tput = results.get("fixed_short"), results.get("hf_throughput")
    rows = []
    if lat and hf_lat:
        rows.append(("meshserve vs transformers, latency", "",
                     f"TPOT {hf_lat['tpot_s']['avg'] / lat['tpot_s']['avg']:.2f}x lower, "
                     f"TTFT {hf_lat['ttft_s']['avg'] / lat['ttft_s']['avg']:.2f}x lower", ""))
    if tput and hf_tput:
        rows.append(("meshserve vs transformers, throughput", "",
                     f"{tput['output_tokens_per_s'] / hf_tput['output_tokens_per_s']:.2f}x the "
                     f"output tok/s ({tput['num_requests']} vs {hf_tput['num_requests']} "
                     f"requests of the same lengths)", ""))
    return rows

env = next((r["environment"] for r in results.values() if isinstance(r, dict) and "environment" in r), {})
lines = [f"meshserve GPU suite on {env.get('gpu_name', env.get('device', '?'))} "
         f"(driver {env.get('driver')}, torch {env.get('torch')}, transformers {env.get('transformers')})",
         "", "| step | status | time | figures | against the budget |", "|---|---|---|---|---|"]
for name, status, seconds in steps:
    text, check = figures(name, results.get(name))
    lines.append(f"| {name} | {status} | {seconds}s | {text} | {check} |")
for name, status, text, check in versus(results):
    lines.append(f"| {name} | {status} | | {text} | {check} |")
table = "\n".join(lines)
(out / "summary.md").write_text(table + "\n")
print(table)
PY

step preflight 60 10 python3 -c "
import importlib, os, sys, torch, transformers
importlib.import_module(os.environ['MESHSERVE_CLI'])
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers',
      transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
if want engine; then
  # The Triton kernels compiled on this GPU against the PyTorch references.
  step kernel_check "${T_KERNEL_CHECK:-60}" 20 env GPU_TEST_OUT="$RUN_DIR" python3 -m pytest \
    -q -p no:cacheprovider tests/gpu/test_gpu_kernels.py
  # Greedy outputs of the GPU path against the CPU path: float32 exact, bfloat16 within bounds.
  step correctness "${T_CORRECTNESS:-90}" 30 env GPU_TEST_OUT="$RUN_DIR" python3 -m pytest \
    -q -p no:cacheprovider tests/gpu/test_gpu_engine_paths.py
  if [ -n "${RUN_KERNEL_BENCH:-}" ]; then
    step kernels "${T_KERNELS:-35}" 20 python3 -m meshserve.kernels.bench_kernels \
      --out "$OUT/kernels.json"
  fi
  # One sequence at a time: --max-num-seqs 1 captures only the batch-1 decode graph.
  bench latency "${T_LATENCY:-50}" 30 latency --input-len "$LATENCY_LEN" \
    --output-len "$LATENCY_LEN" --batch-size 1 --num-iters "$LATENCY_ITERS" \
    --num-iters-warmup 2 --max-num-seqs 1
  # The same with the overlapped loop off: what overlapping the CPU's work buys.
  bench latency_sync "${T_LATENCY_SYNC:-50}" 30 latency --input-len "$LATENCY_LEN" \
    --output-len "$LATENCY_LEN" --batch-size 1 --num-iters "$LATENCY_ITERS" \
    --num-iters-warmup 2 --max-num-seqs 1 --async-scheduling off
  bench sharegpt "${T_SHAREGPT:-75}" 40 throughput --dataset sharegpt-like \
    --num-prompts "$SHAREGPT_PROMPTS" --num-iters-warmup 1
  bench fixed_short "${T_SHORT:-55}" 30 throughput --input-len "$SHORT_IN" \
    --output-len "$SHORT_OUT" --num-prompts "$SHORT_PROMPTS" --num-iters-warmup 1
  bench fixed_long "${T_LONG:-70}" 30 throughput --input-len "$LONG_IN" \
    --output-len "$LONG_OUT" --num-prompts "$LONG_PROMPTS" --num-iters-warmup 1
  # The whole prompt in one step (token budget = prompt), no decode graphs needed.
  bench prefill "${T_PREFILL:-40}" 20 latency --input-len "$PREFILL_LEN" --output-len 1 \
    --batch-size 1 --num-iters "$PREFILL_ITERS" --num-iters-warmup 1 \
    --max-num-batched-tokens "$PREFILL_LEN" --max-num-seqs 1 --enforce-eager
fi
if want peer; then
  # The transformers peer next to `meshserve bench` on the same workloads (the latter run
  # here when the engine section is not).
  if ! want engine; then
    bench latency "${T_LATENCY:-50}" 30 latency --input-len "$LATENCY_LEN" \
      --output-len "$LATENCY_LEN" --batch-size 1 --num-iters "$LATENCY_ITERS" \
      --num-iters-warmup 2 --max-num-seqs 1
    bench fixed_short "${T_SHORT:-55}" 30 throughput --input-len "$SHORT_IN" \
      --output-len "$SHORT_OUT" --num-prompts "$SHORT_PROMPTS" --num-iters-warmup 1
  fi
  hf_peer hf_latency "${T_HF_LATENCY:-90}" 40 latency --input-len "$LATENCY_LEN" \
    --output-len "$LATENCY_LEN" --batch-size 1 --num-iters "$LATENCY_ITERS" --num-iters-warmup 2
  hf_peer hf_throughput "${T_HF_THROUGHPUT:-90}" 40 throughput --input-len "$SHORT_IN" \
    --output-len "$SHORT_OUT" --num-prompts "$HF_PROMPTS" --batch-sizes "$HF_BATCH_SIZES"
fi
if want mesh; then
  # The in-process references of the mesh runs (the same steps as the engine part; run here
  # when that part is not), then the same prompts through `meshserve up`.
  if ! want engine; then
    bench latency "${T_LATENCY:-50}" 30 latency --input-len "$LATENCY_LEN" \
      --output-len "$LATENCY_LEN" --batch-size 1 --num-iters "$LATENCY_ITERS" \
      --num-iters-warmup 2 --max-num-seqs 1
    # A full-size warm-up batch first, as the mesh runs get one (mesh_run.sh): both sides
    # then time steady state, not the first compilation of each kernel variant.
    bench sharegpt "${T_SHAREGPT:-90}" 40 throughput --dataset sharegpt-like \
      --num-prompts "$SHAREGPT_PROMPTS" --num-iters-warmup 1 \
      --warmup-prompts "$SHAREGPT_PROMPTS" --step-trace "$RUN_DIR/sharegpt_steps.jsonl"
  fi
  MESH_MODEL=$RUN_DIR/mesh-model
  step mesh_model 60 10 python3 loadtest/make_tokenizer.py --config "$MODEL_DIR/config.json" \
    --out "$MESH_MODEL"
  # Once per gateway count of MESH_GATEWAYS ("1 2": `meshserve up`'s default, then two
  # gateway processes on the one port).
  for g in $MESH_GATEWAYS; do
    # shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
    step "mesh_g$g" "${T_MESH:-300}" 150 env GATEWAYS="$g" SHAREGPT_PROMPTS="$SHAREGPT_PROMPTS" \
      LATENCY_LEN="$LATENCY_LEN" bash loadtest/gpu/mesh_run.sh "$MESH_MODEL" "$RUN_DIR/mesh_g$g" \
      $ENGINE_FLAGS ${MESH_FLAGS:-}
    step "mesh_report_g$g" 30 5 python3 loadtest/mesh_report.py --run-dir "$RUN_DIR" \
      --mesh-dir "$RUN_DIR/mesh_g$g" --out "$RUN_DIR/mesh_report_g$g.json" \
      --summary "$OUT/mesh_summary_g$g.md"
  done
fi

# ---- 3. the table, last ----------------------------------------------------------------------
tar -czf "$OUT/steps.tar.gz" -C "$RUN_DIR" --exclude=./mesh-model \
  --exclude='./mesh_g*' . || log "!! packing the steps' files failed"
# Each mesh run's files (per-request latencies of every run) on their own, xz-packed.
for dir in "$RUN_DIR"/mesh_g*/; do
  [ -d "$dir" ] || continue
  tar -cJf "$OUT/$(basename "$dir").tar.xz" -C "$RUN_DIR" "$(basename "$dir")" ||
    log "!! packing $dir failed"
done
log "== suite finished in $((SECONDS - START))s"
python3 "$RUN_DIR/report.py" table | tee -a "$OUT/suite.log"
