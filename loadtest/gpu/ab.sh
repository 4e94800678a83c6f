# Part `ab`: the same engine benchmarks on a baseline tree and on this tree, on one GPU in
# one call, each benchmark run on the baseline first and then here, so that a change that
# should not move the figures (a refactor) is checked against the code before it.
#
#   BASE_TREE   a folder holding the baseline's services/ kernels/ shared/ proto/ and
#               pyproject.toml (e.g. `git archive REV services kernels shared proto
#               pyproject.toml | tar -x -C .gl/base`, carried with the call); required
#   AB_BENCHES  which of: latency (128 in / 128 out, batch 1), sharegpt (1000 ShareGPT-like
#               requests at once), prefill (one 8192-token prompt); default all three
#   AB_ORDER    which tree runs each benchmark first (default "base head")
#   ENGINE_FLAGS  as the suite's (dummy weights, --max-model-len 8448)
#
# Writes $OUT/ab/<tree>_<bench>.json and .log, and ab.md: the figures side by side with
# the ratio this tree / baseline.
: "${BASE_TREE:?BASE_TREE must name the folder of the baseline tree}"
AB_BENCHES=${AB_BENCHES:-latency sharegpt prefill}
ENGINE_FLAGS=${ENGINE_FLAGS:---load-format dummy --max-model-len 8448}
MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
BASE_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/ab_base.XXXXXX")
(cd "$BASE_TREE" && gpu_pkgroot "$BASE_ROOT") >/dev/null
# The baseline's `meshserve` command module, wherever that tree kept it.
BASE_CLI=meshserve.cli.main
[ -e "$BASE_ROOT/meshserve/cli/main.py" ] || BASE_CLI=meshserve.services.cli

ab_bench() {  # ab_bench TREE NAME FLAGS...: one `meshserve bench` on TREE (base or head)
  local tree=$1 name=$2 root=$PKGROOT cli=$MESHSERVE_CLI
  shift 2
  if [ "$tree" = base ]; then root=$BASE_ROOT; cli=$BASE_CLI; fi
  # shellcheck disable=SC2086  # ENGINE_FLAGS is a list of flags
  gpu_step "${tree}_$name" 170 env PYTHONPATH="$root:/tmp/site" python3 -m "$cli" bench "$@" \
    --model "$MODEL_DIR" $ENGINE_FLAGS --no-progress --output-json "$OUT/${tree}_$name.json"
}

for bench in $AB_BENCHES; do
  for tree in ${AB_ORDER:-base head}; do
    case $bench in
      latency) ab_bench "$tree" latency latency --input-len 128 --output-len 128 \
        --batch-size 1 --num-iters 5 --num-iters-warmup 2 --max-num-seqs 1 ;;
      sharegpt) ab_bench "$tree" sharegpt throughput --dataset sharegpt-like \
        --num-prompts 1000 --num-iters-warmup 1 ;;
      prefill) ab_bench "$tree" prefill latency --input-len 8192 --output-len 1 \
        --batch-size 1 --num-iters 3 --num-iters-warmup 1 --max-num-batched-tokens 8192 \
        --max-num-seqs 1 --enforce-eager ;;
      *) echo "!! unknown AB_BENCHES entry: $bench" >&2 ;;
    esac
  done
done

python3 - "$OUT" <<'PY' | tee "$OUT/ab.md"
"""The A/B table: each benchmark's figure on the baseline and here, and their ratio."""
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
# (benchmark, label, how to read the figure from its JSON, unit)
rows = [("latency", "TPOT (median)", lambda r: r["tpot_s"]["p50"] * 1e3, "ms"),
        ("latency", "e2e (median)", lambda r: r["latency_s"]["p50"] * 1e3, "ms"),
        ("sharegpt", "output throughput", lambda r: r["output_tokens_per_s"], "tok/s"),
        ("prefill", "8192-token prefill (median)", lambda r: r["latency_s"]["p50"] * 1e3, "ms")]
env = {}
print("| benchmark | baseline | this tree | this / baseline |\n|---|---|---|---|")
for bench, label, read, unit in rows:
    figures = []
    for tree in ("base", "head"):
        path = out / f"{tree}_{bench}.json"
        try:
            result = json.loads(path.read_text())
            env = env or result.get("environment", {})
            figures.append(read(result))
        except (OSError, KeyError, TypeError, ValueError):
            figures.append(None)
    base, head = figures
    ratio = f"{head / base:.3f}" if base and head else "-"
    cell = lambda v: "-" if v is None else f"{v:,.2f} {unit}"  # noqa: E731
    print(f"| {label} | {cell(base)} | {cell(head)} | {ratio} |")
print(f"\nGPU: {env.get('gpu_name', '?')}; torch {env.get('torch', '?')}; "
      f"triton {env.get('triton', '?')}; transformers {env.get('transformers', '?')}")
PY
