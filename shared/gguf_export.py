"""A GGUF file's config and tokenizer as a plain Hugging Face folder, made once and cached.

transformers reads GGUF metadata through a module that imports torch, which the tokenizer
and the gateway must not load (decision 10: hundreds of MB for a process that only needs
text). So the conversion runs once in a child process:

    folder = exported_folder(Path("model.gguf"))   # config.json + tokenizer files

The folder lives under the meshserve cache, keyed by the file's resolved path, size and
modification time; it is written to a temporary name and renamed into place, so processes
that start together (tokenizer and worker) never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from meshserve.shared.default_model import cache_root
from meshserve.shared.errors import ModelLoadError

_DONE_MARK = "export-complete"
_EXPORT_TIMEOUT_S = 600.0
_STDERR_TAIL = 2000


def export_key(gguf_file: Path) -> str:
    """A short stable key of one version of a GGUF file."""
    resolved = gguf_file.expanduser().resolve()
    stat = resolved.stat()
    ident = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    return f"{resolved.stem}-{hashlib.sha256(ident).hexdigest()[:16]}"


def exported_folder(gguf_file: Path, cache_dir: Path | None = None) -> Path:
    """The folder holding `gguf_file`'s config.json and tokenizer files (made if missing)."""
    if not gguf_file.is_file():
        raise ModelLoadError(f"GGUF file {gguf_file} does not exist", param="model")
    root = (cache_dir or cache_root()) / "gguf-export"
    target = root / export_key(gguf_file)
    if (target / _DONE_MARK).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
    try:
        _run_export(gguf_file, scratch)
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / _DONE_MARK).is_file():  # not a concurrent export that won
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _run_export(gguf_file: Path, out: Path) -> None:
    command = [sys.executable, "-m", "meshserve.shared.gguf_export", str(gguf_file), str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=_EXPORT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"{gguf_file}: cannot export its config and tokenizer: {exc}",
                             param="model") from exc
    if done.returncode != 0 or not (out / _DONE_MARK).is_file():
        raise ModelLoadError(f"{gguf_file}: cannot read its GGUF metadata: "
                             f"{done.stderr.strip()[-_STDERR_TAIL:]}", param="model")


def export(gguf_file: Path, out: Path) -> None:
    """In the child: write config.json and the tokenizer of `gguf_file` into `out`."""
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                              local_files_only=True)
    tokenizer.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(parsed["config"], indent=1, default=str),
                                     encoding="utf-8")
    (out / _DONE_MARK).write_text(str(gguf_file), encoding="utf-8")


if __name__ == "__main__":
    export(Path(sys.argv[1]), Path(sys.argv[2]))
