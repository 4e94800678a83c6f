# Sourced by the loadtest/gpu_*.sh scripts: what they need on the GPU machine, without a pip
# install of meshserve. `gpu_env RUN_DIR` installs the carried wheels of .whl/ (if any) into
# /tmp/site and links the repository's folders as the package `meshserve` under
# RUN_DIR/pkgroot, both put on PYTHONPATH (run from the repository root).
gpu_env() {
  local run_dir=$1 folder
  if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
    else
      echo "!! installing the wheels of .whl/ failed" >&2
    fi
  fi
  PKGROOT=$run_dir/pkgroot
  mkdir -p "$PKGROOT/meshserve"
  for folder in services kernels shared proto; do
    ln -sfn "$PWD/$folder" "$PKGROOT/meshserve/$folder"
  done
  export PYTHONPATH=$PKGROOT${PYTHONPATH:+:$PYTHONPATH}
}

# `gpu_step NAME LIMIT_S COMMAND...`: run COMMAND under `timeout` with its output in
# $OUT/NAME.log, note its start, exit code and seconds in $OUT/steps.log, show the last
# $STEP_TAIL lines (default 6) of its log. A NAME listed in $SKIP is noted as skipped.
gpu_step() {
  local name=$1 limit=$2
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped" | tee -a "$OUT/steps.log"
    return
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.log"
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - began))s" | tee -a "$OUT/steps.log"
  tail -"${STEP_TAIL:-6}" "$OUT/$name.log"
}

# `fp8_report TITLE RUN...`: loadtest/fp8_bench.py's table of $OUT/RUN.json (those that
# exist) against the first, appended to $OUT/summary.md under TITLE (needs $RUN_DIR).
fp8_report() {
  local title=$1 runs=() name
  shift
  for name in "$@"; do [ -f "$OUT/$name.json" ] && runs+=("$OUT/$name.json"); done
  ((${#runs[@]} > 1)) || return 0
  python3 loadtest/fp8_bench.py report "${runs[@]}" --out "$RUN_DIR/table.md" >/dev/null &&
    printf '## %s\n\n%s\n\n' "$title" "$(cat "$RUN_DIR/table.md")" >>"$OUT/summary.md"
}

# gpu_script_start (after `cd "$REPO"` and sourcing this file): the common start of a
# loadtest/gpu_*.sh script. OUT (default: a new temporary folder) gets an empty steps.log
# and env.txt (GPU, driver, torch and triton versions); RUN_DIR is a scratch folder removed
# on exit; the environment is offline and unbuffered; then gpu_env RUN_DIR.
gpu_script_start() {
  OUT=${OUT:-$(mktemp -d)}
  RUN_DIR=$(mktemp -d)
  trap 'rm -rf "$RUN_DIR"' EXIT
  mkdir -p "$OUT"
  : >"$OUT/steps.log"
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  gpu_env "$RUN_DIR"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  } >"$OUT/env.txt" 2>&1
}
