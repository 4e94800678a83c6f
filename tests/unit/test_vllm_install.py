"""loadtest/vllm_fetch.sh and loadtest/gpu/vllm_install.sh on CPU: a stand-in vllm wheel cut
into parts, stashed over two calls, joined, checked and installed (and of deps-if-missing/ only
what python3 lacks); a corrupted part is refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from vllm_stand_in import ENV, fetched, installer


def test_parts_stashed_over_two_calls_install_and_a_bad_part_is_refused(tmp_path: Path
                                                                        ) -> None:
    src = fetched(tmp_path, "VERSION = 'joined'\n")
    parts = sorted(p.name for p in src.glob("part*"))
    assert len(parts) >= 3
    record = (src / "part00" / "wheel.txt").read_text()
    assert f"parts={len(parts)}" in record and "name=vllm-0.0.1-py3-none-any.whl" in record
    store, first = tmp_path / "store", tmp_path / "call1"
    first.mkdir()
    shutil.copytree(src / "part00", first / "part00")
    assert installer("stash", first, store).returncode == 0
    status = installer("status", store)
    assert status.returncode == 3
    assert f"1 of {len(parts)} parts" in status.stdout and "deps-if-missing" in status.stdout
    assert installer("install", store).returncode == 3
    assert installer("stash", src, store).returncode == 0
    assert installer("status", store).returncode == 0
    done = installer("install", store)
    assert done.returncode == 0, done.stderr
    assert "have pytest" in done.stderr
    site = store / "site"
    code = ("import vllm, meshdep_always, meshdep_missing; "
            "print(vllm.VERSION, meshdep_always.X, meshdep_missing.Y)")
    run = subprocess.run([sys.executable, "-c", code], env={**ENV, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=False)
    assert run.stdout.split() == ["joined", "1", "2"], run.stderr
    assert not list(site.glob("pytest*"))
    assert installer("installed", store).returncode == 0
    assert "already installed" in installer("install", store).stdout
    # A part that changed on the way: the joined wheel fails its sha256, nothing is installed.
    shutil.rmtree(site)
    chunk = store / "part01" / "chunk"
    chunk.write_bytes(b"x" + chunk.read_bytes()[1:])
    bad = installer("install", store)
    assert bad.returncode == 1 and "sha256" in bad.stderr
    assert not site.exists() and installer("installed", store).returncode == 1
