# The one preamble of the GPU driver (loadtest/gpu.sh sources it; no part repeats it): what
# the parts need on the GPU machine, without a pip install of meshserve. Run from the
# repository root.

# `gpu_pkgroot DIR`: DIR/meshserve/X linked to its folder for every `meshserve.X` of
# pyproject.toml's [tool.setuptools.package-dir] (DIR/meshserve stays a namespace package, no
# __init__.py). A package inside one already linked (meshserve.a.b with meshserve.a) comes
# with its parent's link. Prints the linked names.
gpu_pkgroot() {
  mkdir -p "$1/meshserve"
  python3 - "$1" "$PWD" <<'PY'
import re, sys
from pathlib import Path

root, repo = Path(sys.argv[1]), Path(sys.argv[2])
text = (repo / "pyproject.toml").read_text()
try:
    import tomllib
    table = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
except ImportError:  # Python < 3.11: the table's `"key" = "value"` lines
    body = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    table = dict(re.findall(r'^\s*"([^"]+)"\s*=\s*"([^"]+)"', body, re.M))
linked: list[str] = []
for name in sorted((n for n in table if n.startswith("meshserve.")), key=len):
    if any(name.startswith(done + ".") for done in linked):
        continue
    link = root.joinpath(*name.split("."))
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(repo / table[name], target_is_directory=True)
    linked.append(name)
print(" ".join(linked))
PY
}

# `gpu_install_wheels TARGET WHEEL...`: the wheels installed into TARGET, offline, none of
# their dependencies resolved, no bytecode compiled, replacing what TARGET held of them.
gpu_install_wheels() {
  local target=$1
  shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" "$@"
}

# `gpu_env RUN_DIR`: the carried wheels of .whl/ (if any) installed into /tmp/site, the
# package root RUN_DIR/pkgroot (gpu_pkgroot), both put on PYTHONPATH; MESHSERVE_CLI names the
# module of the `meshserve` command (`python3 -m "$MESHSERVE_CLI" bench ...`).
gpu_env() {
  local run_dir=$1
  if compgen -G ".whl/*.whl" >/dev/null; then
    if gpu_install_wheels /tmp/site .whl/*.whl; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
    else
      echo "!! installing the wheels of .whl/ failed" >&2
    fi
  fi
  PKGROOT=$run_dir/pkgroot
  gpu_pkgroot "$PKGROOT" >/dev/null || echo "!! linking the package meshserve failed" >&2
  export PKGROOT PYTHONPATH=$PKGROOT${PYTHONPATH:+:$PYTHONPATH}
  export MESHSERVE_CLI=meshserve.cli.main
}

# `gpu_envinfo FILE`: the GPUs, driver, torch, triton and transformers versions into FILE.
gpu_envinfo() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, \
'triton', triton.__version__, 'transformers', transformers.__version__, 'nccl', \
torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
    nproc; free -g
  } >"$1" 2>&1
}

# `gpu_step NAME LIMIT_S COMMAND...`: run COMMAND under `timeout` with its output in
# $OUT/NAME.log, note its start, exit code and seconds in $OUT/steps.log, show the last
# $STEP_TAIL lines (default 6) of its log; returns COMMAND's exit code. A NAME listed in
# $SKIP is noted as skipped (and returns 0).
gpu_step() {
  local name=$1 limit=$2 rc
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped" | tee -a "$OUT/steps.log"
    return
  fi
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.log"
  local began=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc in $((SECONDS - began))s" | tee -a "$OUT/steps.log"
  tail -"${STEP_TAIL:-6}" "$OUT/$name.log"
  return $rc
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

# `gpu_start`: the driver's start. OUT (default: a new temporary folder) gets env.txt;
# RUN_ROOT is a scratch folder removed on exit; the environment is offline and unbuffered;
# then gpu_env RUN_ROOT.
gpu_start() {
  OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_out.XXXXXX")}
  RUN_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_run.XXXXXX")
  trap 'rm -rf "$RUN_ROOT"' EXIT
  mkdir -p "$OUT"
  export OUT RUN_ROOT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
  gpu_env "$RUN_ROOT"
  gpu_envinfo "$OUT/env.txt"
}

# `gpu_part_dirs PART`: OUT=$OUT/PART (the part's results) and RUN_DIR (its scratch folder),
# with an empty steps.log. Called in the subshell a part runs in.
gpu_part_dirs() {
  OUT=$OUT/$1
  RUN_DIR=$(mktemp -d "$RUN_ROOT/$1.XXXXXX")
  mkdir -p "$OUT"
  : >"$OUT/steps.log"
  export OUT RUN_DIR
}
