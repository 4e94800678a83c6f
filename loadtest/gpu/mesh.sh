# Part `mesh` of loadtest/gpu.sh: the mesh against its engine on one GPU in one call: the
# suite's mesh section (loadtest/gpu/suite.sh: in-process references, then `meshserve up` +
# `meshserve bench serve` through loadtest/gpu/mesh_run.sh) once per variant, each variant
# next to an in-process run of its own, so that an in-process run-to-run swing shows up as
# such instead of as a mesh cost. The GPU's clocks, power and temperature are logged
# alongside (nvidia-smi), and every step trace carries the device's own time.
#
# Knobs: VARIANTS (default "default": `meshserve up` flags per run, "default" for none,
# "traced" for the default with every service's spans exported to loadtest/otlp_sink.py and
# summarised hop by hop for the timed burst by loadtest/trace_hops.py; e.g.
# "--no-kvstore default" for the KV tier off and on), MESH_GATEWAYS ("1" with more than one
# variant, else the suite's "1 2"), SWEEP (mesh_run.sh's concurrency sweep; " " with more than
# one variant), SHAREGPT_PROMPTS (1000), and the suite's. What comes back in $OUT: each
# variant's suite files under <n>_<variant>/ (mesh_summary_gG.md, results.json, mesh_gG.tar.xz;
# spans.jsonl and hops.json for "traced"), smi.csv, and ab.md (each variant's mesh summary,
# in order, and the hops).
VARIANTS=${VARIANTS:-default}
read -r -a variants <<<"$VARIANTS"
if ((${#variants[@]} > 1)); then
  export MESH_GATEWAYS=${MESH_GATEWAYS:-1} SWEEP=${SWEEP:- } PYSPY_S=${PYSPY_S:-0}
  export SUITE_BUDGET_S=${SUITE_BUDGET_S:-280}
fi
SMI=""
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 500 >"$OUT/smi.csv" 2>/dev/null &
  SMI=$!
fi
: >"$OUT/ab.md"
n=0
for variant in $VARIANTS; do
  n=$((n + 1))
  flags=$variant
  [ "$variant" = default ] && flags=""
  dir="$OUT/${n}_${variant#--}"
  mkdir -p "$dir"
  sink=""
  if [ "$variant" = traced ]; then
    port=$((14000 + RANDOM % 1000))
    python3 loadtest/otlp_sink.py --port "$port" --out "$dir/spans.jsonl" >"$dir/sink.log" 2>&1 &
    sink=$!
    flags="--otlp-endpoint 127.0.0.1:$port"
  fi
  echo "== variant $n: ${variant} ($(date -u +%H:%M:%S))" | tee -a "$OUT/ab.md"
  # shellcheck source=loadtest/gpu/suite.sh
  ( OUT=$dir SUITE_SECTIONS=mesh MESH_FLAGS="$flags"
    . loadtest/gpu/suite.sh ) >"$dir/console.log" 2>&1
  cat "$dir/mesh_summary_g1.md" >>"$OUT/ab.md" 2>/dev/null ||
    echo "(no mesh summary: see $dir/console.log)" >>"$OUT/ab.md"
  if [ -n "$sink" ]; then
    kill -INT "$sink" 2>/dev/null
    wait "$sink" 2>/dev/null
    # The spans of mesh_run.sh's timed burst: after its warm-up burst of the same size.
    python3 loadtest/trace_hops.py "$dir/spans.jsonl" --skip "${SHAREGPT_PROMPTS:-1000}" \
      --count "${SHAREGPT_PROMPTS:-1000}" --out "$dir/hops.json" >>"$OUT/ab.md" 2>&1
  fi
done
[ -n "$SMI" ] && kill "$SMI" 2>/dev/null
cat "$OUT/ab.md"
