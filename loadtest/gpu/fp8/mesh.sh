# FP8_RUNS entry `mesh` of part `fp8` (loadtest/gpu/fp8.sh; results in $OUT/fp8/mesh):
# FP8 through the whole mesh on one GPU: `meshserve up` on the Llama-3.1-8B shape (dummy
# weights, a tokenizer of its vocabulary from loadtest/make_tokenizer.py) in bf16 and with
# FP8 weights, FP8 LM head and FP8 KV cache, each measured by loadtest/gpu/mesh_run.sh (1000
# ShareGPT-like requests at once after a full-size warm-up burst, then LAT_PROMPTS single
# streams of LAT_LEN in / LAT_LEN out), and the served figures tabled side by side.
#
#     FP8_RUNS=mesh bash loadtest/gpu.sh fp8
#
# Steps (limits): tokenizer (60 s), mesh_bf16 and mesh_fp8 (240 s each). SKIP as elsewhere.
MODEL=$RUN_DIR/mesh8b
LAT_LEN=${LAT_LEN:-128}
LAT_PROMPTS=${LAT_PROMPTS:-4}
gpu_step tokenizer 60 python3 loadtest/make_tokenizer.py \
  --config loadtest/models/llama-3.1-8b/config.json --out "$MODEL"
mesh() {  # mesh NAME ENGINE_FLAGS...
  local name=$1
  shift
  gpu_step "$name" 240 env SWEEP=" " PYSPY_S=0 LATENCY_LEN="$LAT_LEN" \
    LATENCY_PROMPTS="$LAT_PROMPTS" bash loadtest/gpu/mesh_run.sh "$MODEL" "$OUT/$name" \
    --load-format dummy --max-model-len 4096 "$@"
}
mesh mesh_bf16
mesh mesh_fp8 --quantization fp8 --quantize-lm-head --kv-cache-dtype fp8

python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def figures(name):
    try:
        burst = json.loads((out / name / "mesh_sharegpt.json").read_text())
        single = json.loads((out / name / "mesh_latency.json").read_text())
    except (OSError, ValueError):
        return None
    return burst.get("output_throughput"), single.get("median_tpot_ms")
rows = {name: figures(name) for name in ("mesh_bf16", "mesh_fp8")}
print("| served through the mesh | output tok/s, 1000 requests at once | single-stream TPOT ms (median) |")
print("|---|---|---|")
for name, f in rows.items():
    print(f"| {name} | {f'{f[0]:,.0f}' if f else '-'} | {f'{f[1]:.2f}' if f else '-'} |")
b, f = rows["mesh_bf16"], rows["mesh_fp8"]
if b and f and all(v is not None for v in (*b, *f)):
    print(f"\nFP8 (weights, LM head, KV) / bf16: throughput {f[0] / b[0]:.3f}x, "
          f"TPOT {f[1] / b[1]:.3f}x")
PY
