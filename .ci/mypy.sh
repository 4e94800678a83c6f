#!/usr/bin/env bash
# The project's mypy. The packages install under one import root, `meshserve`, from several
# folders (pyproject.toml's [tool.setuptools.package-dir]), which the editable install finds
# through an import hook mypy does not use: run over the folders, mypy would see every
# `meshserve.*` import as Any. So this links each `meshserve.X` of the table to its folder in
# a package root of its own (as loadtest/gpu/env.sh's gpu_pkgroot does on the GPU machine)
# and checks every one of them as a package there, with pyproject.toml's [tool.mypy].
# Messages name the repository's paths; the exit status is mypy's. Extra arguments go to
# mypy.
#
# The root is a fixed folder in mypy's cache, made for the run and removed after it: mypy's
# cache holds modules by path, so a root at a new path each time would recheck everything
# (about 9 s instead of 1 s when nothing changed). Runs in one checkout take turns.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
cache=$repo/.mypy_cache
root=$cache/pkgroot
mkdir -p "$cache" || exit 2
if command -v flock >/dev/null; then
    exec 9>"$cache/pkgroot.lock" && flock 9
fi
rm -rf "$root"
trap 'rm -rf "$root"' EXIT

# Line 1: "-p meshserve.X" for every linked package; then "PREFIX<TAB>FOLDER/" for each.
plan=$(python3 - "$root" "$repo" <<'PY'
import sys
import tomllib
from pathlib import Path

root, repo = Path(sys.argv[1]), Path(sys.argv[2])
table = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
linked: list[str] = []
for name in sorted((n for n in table if n.startswith("meshserve.")), key=len):
    if any(name.startswith(done + ".") for done in linked):
        continue  # inside a package already linked: comes with its parent's link
    link = root.joinpath(*name.split("."))
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(repo / table[name], target_is_directory=True)
    linked.append(name)
print(" ".join(f"-p {name}" for name in linked))
for name in linked:
    print(f"{name.replace('.', '/')}/\t{table[name].rstrip('/')}/")
PY
) || exit 2
read -ra packages <<<"$(head -n1 <<<"$plan")"
# meshserve/bench/x.py:1: error -> loadtest/bench/x.py:1: error
rewrite=$(tail -n +2 <<<"$plan" | while IFS=$'\t' read -r prefix folder; do
    printf 's|^%s|%s|;' "$prefix" "$folder"
done)

cd "$root"
MYPYPATH=$root mypy --config-file "$repo/pyproject.toml" --cache-dir "$cache" \
    --namespace-packages --explicit-package-bases "${packages[@]}" "$@" | sed -e "$rewrite"
exit "${PIPESTATUS[0]}"
