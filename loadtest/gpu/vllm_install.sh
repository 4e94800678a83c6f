#!/usr/bin/env bash
# vLLM for the GPU driver's part `vllm` (loadtest/gpu/vllm.sh), from what
# loadtest/vllm_fetch.sh prepared in .vllm/: the wheel cut into part<NN>/ folders (each holding
# its `chunk` and wheel.txt: the wheel's name, sha256, size and number of parts) and the
# dependency wheels in deps/ (always installed) and deps-if-missing/ (installed only where
# python3 does not find the distribution already), each with its SHA256SUMS. A call carries a
# few of them; they are kept in STORE, a folder outside the repository that stays while the
# machine does, until all are there.
#
#   bash loadtest/gpu/vllm_install.sh stash SRC STORE   copy SRC's part*/ and deps*/ into STORE
#   bash loadtest/gpu/vllm_install.sh status STORE      what STORE holds; exit 0 when complete
#   bash loadtest/gpu/vllm_install.sh install STORE     join the parts, check every sha256,
#       install the wheel and the dependencies into STORE/site (built beside it, then moved in
#       place); nothing to do when STORE/site already holds this wheel; non-zero on a failure
#   bash loadtest/gpu/vllm_install.sh installed STORE   exit 0 when STORE/site holds the wheel
#
# Run with the driver's environment (PYTHONPATH of the preamble): deps-if-missing/ is checked
# against what that python3 finds.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=loadtest/gpu/env.sh
. "$HERE/env.sh"

# wheel_field STORE KEY: KEY's value in the wheel.txt of STORE's first part folder.
wheel_field() {
  local record
  record=$(compgen -G "$1/part*/wheel.txt" | sort | head -1)
  [ -n "$record" ] && sed -n "s/^$2=//p" "$record"
}

stash() {
  local src=$1 store=$2 dir name
  mkdir -p "$store" || return 1
  for dir in "$src"/part* "$src"/deps*; do
    [ -d "$dir" ] || continue
    name=$(basename "$dir")
    rm -rf "${store:?}/$name.new"
    cp -r "$dir" "$store/$name.new" && rm -rf "${store:?}/$name" &&
      mv "$store/$name.new" "$store/$name" || return 1
    echo "stashed $name ($(du -sh "$store/$name" | cut -f1)) in $store"
  done
}

status() {
  local store=$1 sha parts i missing=() here=0
  sha=$(wheel_field "$store" sha256)
  parts=$(wheel_field "$store" parts)
  if [ -z "$sha" ] || [ -z "$parts" ]; then
    echo "vLLM: no part in $store yet"
    return 3
  fi
  for ((i = 0; i < parts; i++)); do
    local dir
    dir=$store/part$(printf %02d "$i")
    if [ -f "$dir/chunk" ] && grep -qx "sha256=$sha" "$dir/wheel.txt"; then
      here=$((here + 1))
    else
      missing+=("$(basename "$dir")")
    fi
  done
  for dir in deps deps-if-missing; do
    [ -f "$store/$dir/SHA256SUMS" ] || missing+=("$dir")
  done
  echo "vLLM $(wheel_field "$store" name): $here of $parts parts in $store; missing:" \
    "${missing[*]:-none}"
  ((${#missing[@]} == 0)) || return 3
}

installed() {
  local sha
  sha=$(wheel_field "$1" sha256)
  [ -n "$sha" ] && [ "$(cat "$1/site/.wheel-sha256" 2>/dev/null)" = "$sha" ]
}

# if_missing WHEEL...: the wheels whose distribution python3 does not find installed (the
# others are named on stderr with the version found).
if_missing() {
  python3 - "$@" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

for wheel in sys.argv[1:]:
    name = Path(wheel).name.split("-")[0]
    try:
        print(f"have {name} {metadata.version(name)}: not installing {Path(wheel).name}",
              file=sys.stderr)
    except metadata.PackageNotFoundError:
        print(wheel)
PY
}

install() {
  local store=$1 sha name parts wheel new i dir missing=()
  status "$store" || return 3
  if installed "$store"; then
    echo "vLLM already installed in $store/site"
    return 0
  fi
  sha=$(wheel_field "$store" sha256)
  name=$(wheel_field "$store" name)
  parts=$(wheel_field "$store" parts)
  wheel=$store/$name
  : >"$wheel" || return 1
  for ((i = 0; i < parts; i++)); do
    cat "$store/part$(printf %02d "$i")/chunk" >>"$wheel" || return 1
  done
  if ! echo "$sha  $wheel" | sha256sum -c --quiet -; then
    echo "!! $name: sha256 does not match wheel.txt's" >&2
    rm -f "$wheel"
    return 1
  fi
  for dir in deps deps-if-missing; do
    (cd "$store/$dir" && sha256sum -c --quiet SHA256SUMS) ||
      { echo "!! $store/$dir: sha256 mismatch" >&2; return 1; }
  done
  while read -r i; do missing+=("$i"); done < <(if_missing "$store"/deps-if-missing/*.whl)
  new=$store/site.new
  rm -rf "$new"
  echo "installing $name, $(compgen -G "$store/deps/*.whl" | wc -l) wheels of deps/ and" \
    "${#missing[@]} of deps-if-missing/ into $store/site"
  if ! gpu_install_wheels "$new" "$wheel" "$store"/deps/*.whl ${missing[@]+"${missing[@]}"}
  then
    echo "!! installing $name into $new failed" >&2
    rm -rf "$new"
    return 1
  fi
  # Bytecode now, so that vLLM's timed start does not compile its modules.
  python3 -m compileall -q -j 0 "$new" >/dev/null ||
    echo "!! compileall reported errors: those modules compile when first imported" >&2
  echo "$sha" >"$new/.wheel-sha256"
  rm -rf "$store/site" && mv "$new" "$store/site" && rm -f "$wheel"
}

usage() {
  echo "usage: bash loadtest/gpu/vllm_install.sh stash SRC STORE | status|install|installed STORE" >&2
  exit 2
}

case ${1:-} in
  stash) (($# == 3)) || usage; stash "$2" "$3" ;;
  status | install | installed) (($# == 2)) || usage; "$1" "$2" ;;
  *) usage ;;
esac
