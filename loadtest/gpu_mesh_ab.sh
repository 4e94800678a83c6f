#!/usr/bin/env bash
# The mesh against its engine, with and without the KV tier, on one GPU in one call:
# gpu_suite.sh's mesh part (in-process references, then `meshserve up` + `meshserve bench
# serve`) once per variant, each variant next to an in-process run of its own, so that an
# in-process run-to-run swing shows up as such instead of as a mesh cost. The GPU's clocks,
# power and temperature are logged alongside (nvidia-smi), and every step trace carries the
# device's own time (work, idle gaps, KV tier gathers; services/worker/engine/device_timeline.py).
#
#     bash loadtest/gpu_mesh_ab.sh            # from the repository root; results in $OUT
#
# Knobs: VARIANTS (default "--no-kvstore default": `meshserve up` flags per run, "default"
# for none, "traced" for the default with every service's spans exported to
# loadtest/otlp_sink.py and summarised hop by hop for the timed burst by
# loadtest/trace_hops.py), SHAREGPT_PROMPTS (1000). What comes back in $OUT: ab.tgz (each
# variant's suite files under <n>_<variant>/, spans.jsonl and hops.json for "traced",
# smi.csv) and ab.md (each variant's mesh summary, in order, and the hops).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_mesh_ab_out.XXXXXX")}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_mesh_ab.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
VARIANTS=${VARIANTS:---no-kvstore default}
# The carried wheels and the package, for the span sink and trace_hops.py (gpu_suite.sh
# sets up its own).
# shellcheck source=loadtest/gpu_env.sh
. loadtest/gpu_env.sh
gpu_env "$WORK"

SMI=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 500 >"$WORK/smi.csv" 2>/dev/null &
  SMI=$!
fi
: >"$OUT/ab.md"
n=0
for variant in $VARIANTS; do
  n=$((n + 1))
  flags=$variant
  [ "$variant" = default ] && flags=""
  dir="$WORK/${n}_${variant#--}"
  mkdir -p "$dir"
  sink=""
  if [ "$variant" = traced ]; then
    port=$((14000 + RANDOM % 1000))
    python3 loadtest/otlp_sink.py --port "$port" --out "$dir/spans.jsonl" >"$dir/sink.log" 2>&1 &
    sink=$!
    flags="--otlp-endpoint 127.0.0.1:$port"
  fi
  echo "== variant $n: ${variant} ($(date -u +%H:%M:%S))" | tee -a "$OUT/ab.md"
  OUT=$dir PARTS=mesh MESH_GATEWAYS=1 SWEEP=" " PYSPY_S=0 MESH_FLAGS="$flags" \
    SUITE_BUDGET_S=280 bash loadtest/gpu_suite.sh >"$dir/console.log" 2>&1
  cat "$dir/mesh_summary_g1.md" >>"$OUT/ab.md" 2>/dev/null ||
    echo "(no mesh summary: see $dir/console.log)" >>"$OUT/ab.md"
  if [ -n "$sink" ]; then
    kill -INT "$sink" 2>/dev/null
    wait "$sink" 2>/dev/null
    # The spans of gpu_mesh.sh's timed burst: after its warm-up burst of the same size.
    python3 loadtest/trace_hops.py "$dir/spans.jsonl" --skip "${SHAREGPT_PROMPTS:-1000}" \
      --count "${SHAREGPT_PROMPTS:-1000}" --out "$dir/hops.json" >>"$OUT/ab.md" 2>&1
  fi
done
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
tar -czf "$OUT/ab.tgz" -C "$WORK" --exclude=./pkgroot .
cat "$OUT/ab.md"
