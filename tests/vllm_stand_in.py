"""A stand-in for vLLM in the tests of its peer runner (loadtest/vllm_offline.py) and of the
GPU driver's part `vllm`: the `vllm` package's source, pure-Python wheels, and what
loadtest/vllm_fetch.sh prepares for loadtest/gpu/vllm_install.sh, built from them."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INSTALLER = REPO / "loadtest" / "gpu" / "vllm_install.sh"
# python3 is this interpreter (with pip), as on the GPU machine python3 is the one with torch.
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel of `files` (path in the wheel -> text), with a valid RECORD."""
    dist = f"{name}-{version}.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
                                          f"Version: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return wheel


def dependency_folder(folder: Path, wheels: list[tuple[str, str]]) -> None:
    folder.mkdir(parents=True)
    for name, code in wheels:
        make_wheel(folder, name, "1.0", {f"{name}/__init__.py": code})
    subprocess.run("sha256sum -- *.whl >SHA256SUMS", shell=True, cwd=folder, check=True)


def fetched(tmp_path: Path, vllm_code: str) -> Path:
    """What loadtest/vllm_fetch.sh prepares (dependency folders given, no download): a
    stand-in vllm wheel in parts of 400 bytes, deps/ and deps-if-missing/."""
    src = tmp_path / "carried"
    dependency_folder(src / "deps", [("meshdep_always", "X = 1\n")])
    # pytest is installed here, so only meshdep_missing should be installed.
    dependency_folder(src / "deps-if-missing", [("meshdep_missing", "Y = 2\n"), ("pytest", "")])
    wheel = make_wheel(tmp_path, "vllm", "0.0.1", {"vllm/__init__.py": vllm_code,
                                                   "vllm/padding.py": "#" * 900 + "\n"})
    done = subprocess.run(["bash", "loadtest/vllm_fetch.sh"], cwd=REPO, capture_output=True,
                          text=True, check=False, env={**ENV, "VLLM_DIR": str(src),
                                                       "DOWNLOAD": "0", "PART_BYTES": "400",
                                                       "VLLM_WHEEL": str(wheel)})
    assert done.returncode == 0, done.stderr
    assert "1. carry [" in done.stdout and ": bash loadtest/gpu.sh vllm" in done.stdout
    return src


def installer(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALLER), *map(str, args)], capture_output=True,
                          text=True, check=False, env=ENV)


# A stand-in for the `vllm` package: LLM, SamplingParams and TokensPrompt as the script uses
# them. It records every call and advances CLOCK as a GPU would take time: START_S to start,
# then per generate call PREFILL_S plus DECODE_S per output token of its longest request.
FAKE_VLLM = '''
from types import SimpleNamespace

__version__ = "0.0-stand-in"
CLOCK = [0.0]
CALLS = []
START_S, PREFILL_S, DECODE_S = 3.0, 0.05, 0.01


def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": prompt_token_ids}


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def _ns(**kwargs):
    return SimpleNamespace(**kwargs)


class LLM:
    def __init__(self, **kwargs):
        CALLS.append(("init", kwargs))
        CLOCK[0] += START_S
        self.llm_engine = _ns(vllm_config=_ns(
            cache_config=_ns(num_gpu_blocks=1234, block_size=16, enable_prefix_caching=True),
            scheduler_config=_ns(max_num_seqs=1024, max_num_batched_tokens=16384),
            model_config=_ns(dtype="torch.bfloat16", max_model_len=kwargs.get("max_model_len")),
            attention_config=_ns(backend="FLASH_ATTN"),
            parallel_config=_ns(tensor_parallel_size=kwargs.get("tensor_parallel_size", 1))))

    def generate(self, prompts, params, use_tqdm=True):
        CALLS.append(("generate", [p["prompt_token_ids"] for p in prompts],
                      [dict(vars(q)) for q in params], use_tqdm))
        CLOCK[0] += PREFILL_S + DECODE_S * max(q.max_tokens for q in params)
        return [_ns(outputs=[_ns(token_ids=[7] * q.max_tokens)]) for q in params]
'''
