#!/usr/bin/env bash
# Prepares vLLM for the GPU driver's part `vllm` (loadtest/gpu/vllm.sh), on a machine with
# pip and a registry (the GPU machines have neither): `bash loadtest/vllm_fetch.sh` from the
# repository root. Writes the ignored folder .vllm/:
#   part00/ part01/ ...  the vLLM wheel cut into chunks of at most PART_MB MB (`chunk`), each
#                        with wheel.txt (the wheel's name, sha256, size, number of parts)
#   deps/                the wheels vLLM's offline path imports that the GPU image lacks
#                        (always installed), with SHA256SUMS
#   deps-if-missing/     wheels it imports that the image is known to hold (installed there
#                        only where python3 does not find them), with SHA256SUMS
# and prints the device calls that carry them (at most 64 MiB a call, the working tree
# included; .whl/ rides with the last call, which runs the benchmarks). Distributions that
# .whl/ already carries are left out, so that each is installed once.
#
# Knobs: VLLM_WHEEL (the downloaded vllm-0.22.0 wheel), PART_MB (50; or PART_BYTES), CALL_MIB
# (64), MARGIN_MB (3: room for files the tree gains before the calls), DEPS, DEPS_IF_MISSING
# (pip requirements), DOWNLOAD (0: keep the dependency folders already there), VLLM_DIR (.vllm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VLLM_WHEEL=${VLLM_WHEEL:-/tmp/vllmwheel/vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl}
PART_BYTES=${PART_BYTES:-$((${PART_MB:-50} * 1000000))}
OUT_DIR=${VLLM_DIR:-.vllm}
# What the offline `LLM` path imports beyond the GPU image and .whl/ (pins: vLLM 0.22's own;
# openai 2.8.1, since later releases import httpx2; llguidance below 1.8, the newest with
# a wheel for these platforms).
DEPS=${DEPS:-msgspec pyzmq cbor2 blake3 openai==2.8.1 partial-json-parser cachetools sniffio
jiter distro diskcache==5.6.3 lark==1.2.2 compressed-tensors==0.15.0.1 depyf==0.20.0 astor dill
lm-format-enforcer==0.11.3 interegular outlines_core==0.2.14 llguidance<1.8 mistral_common
pydantic-extra-types pycountry setproctitle python-json-logger pybase64 ijson watchfiles
openai-harmony jsonschema referencing rpds-py jsonschema-specifications fastapi starlette}
# Imported at module level on that path too, and in the image's package list
# (KINDS.md): carried in case a machine lacks one.
DEPS_IF_MISSING=${DEPS_IF_MISSING:-annotated-doc httpx httpcore h11 anyio idna certifi
cloudpickle uvloop einops py-cpuinfo psutil regex tqdm requests urllib3 charset-normalizer
pyyaml jinja2 markupsafe prometheus_client}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

[ -f "$VLLM_WHEEL" ] || { echo "no vLLM wheel at $VLLM_WHEEL (set VLLM_WHEEL)" >&2; exit 1; }
[ "$OUT_DIR" != .vllm ] || grep -qx "/.vllm/" .gitignore ||
  { echo "/.vllm/ is not in .gitignore" >&2; exit 1; }
mkdir -p "$OUT_DIR"

# download DIR REQUIREMENT...: cp312 wheels for x86-64 Linux into DIR (emptied first), less
# the distributions .whl/ holds, with DIR/SHA256SUMS.
download() {
  local dir=$1 wheel
  shift
  rm -rf "$dir" && mkdir -p "$dir"
  # shellcheck disable=SC2068  # the requirements are words
  python3 -m pip download -q -d "$dir" --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" $@
  for wheel in "$dir"/*.whl; do
    if compgen -G ".whl/$(basename "$wheel" | cut -d- -f1)-*.whl" >/dev/null; then
      echo "  $(basename "$wheel"): .whl/ carries it; left out"
      rm "$wheel"
    fi
  done
  (cd "$dir" && sha256sum -- *.whl >SHA256SUMS)
}

if [ "${DOWNLOAD:-1}" != 0 ]; then
  echo "== dependency wheels (cp312, x86-64)"
  # shellcheck disable=SC2086  # the lists are words
  download "$OUT_DIR/deps" $DEPS
  # shellcheck disable=SC2086
  download "$OUT_DIR/deps-if-missing" $DEPS_IF_MISSING
fi

echo "== $(basename "$VLLM_WHEEL") in parts of at most $PART_BYTES bytes"
name=$(basename "$VLLM_WHEEL")
sha=$(sha256sum "$VLLM_WHEEL" | cut -d' ' -f1)
size=$(stat -c %s "$VLLM_WHEEL")
rm -rf "$OUT_DIR"/part* "$OUT_DIR/split.tmp"
mkdir "$OUT_DIR/split.tmp"
split -b "$PART_BYTES" -d -a 2 "$VLLM_WHEEL" "$OUT_DIR/split.tmp/"
parts=$(find "$OUT_DIR/split.tmp" -type f | wc -l)
for chunk in "$OUT_DIR"/split.tmp/*; do
  dir=$OUT_DIR/part$(basename "$chunk")
  mkdir "$dir"
  mv "$chunk" "$dir/chunk"
  printf 'name=%s\nsha256=%s\nsize=%s\nparts=%s\n' "$name" "$sha" "$size" "$parts" \
    >"$dir/wheel.txt"
done
rmdir "$OUT_DIR/split.tmp"
echo "$name: sha256 $sha, $size bytes, $parts parts"

echo "== the device calls"
python3 - "$OUT_DIR" "${CALL_MIB:-64}" "${MARGIN_MB:-3}" <<'PY'
"""Packs the folders of .vllm/ into device calls (first fit, largest first); .whl/ rides with
the last call, which also installs and runs the benchmarks."""
import subprocess
import sys
from pathlib import Path

out, call_mib, margin_mb = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
# What every call sends: tracked files and untracked ones git does not ignore.
listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], check=True,
                        capture_output=True).stdout.decode().split("\0")
tree = sum(p.stat().st_size for p in map(Path, listed) if p.is_file())
size = lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())  # noqa: E731
room = call_mib * 2**20 - tree - margin_mb * 1e6
items = sorted(((size(d), d.as_posix()) for d in out.iterdir() if d.is_dir()), reverse=True)
whl = Path(".whl")
last = [size(whl), [whl.as_posix()]] if whl.is_dir() else [0, []]
calls = [last]
for bytes_, name in items:
    if bytes_ > room:
        sys.exit(f"{name} ({bytes_ / 1e6:.1f} MB) does not fit one call ({room / 1e6:.1f} MB "
                 "beside the tree): lower PART_MB")
    fit = next((c for c in calls if c[0] + bytes_ <= room), None)
    if fit is None:
        fit = [0, []]
        calls.insert(len(calls) - 1, fit)
    fit[0] += bytes_
    fit[1].append(name)
calls[:-1] = sorted(calls[:-1], key=lambda call: sorted(call[1]))
print(f"tree {tree / 2**20:.1f} MiB; each call below carries at most {room / 2**20:.1f} MiB "
      "more. Make the calls back to back on one machine: it keeps what they carry in "
      "/root/vllm-store (VLLM_STORE) only while it stays warm; each call's status line says "
      "what it holds.")
for number, (bytes_, carry) in enumerate(calls, start=1):
    final = number == len(calls)
    command = "bash loadtest/gpu.sh vllm" if final else "VLLM_BENCH=0 bash loadtest/gpu.sh vllm"
    carried = ", ".join(f'"{c}"' for c in sorted(carry))
    print(f"{number}. carry [{carried}] ({bytes_ / 2**20:.1f} MiB): {command}"
          + ("   (installs, then benchmarks; add knobs such as MODEL_DIR=... here)"
             if final else "   (stashes)"))
PY
