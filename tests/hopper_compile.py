"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU, to check each
launch shape's shared memory and register spills as a JIT launch on an H100 would build it.

A test writes a script that calls `build(...)` for each launch and prints the list as JSON
on its last line; `compile_launches(script)` runs it in a child process (the test process
may have Triton's interpreter switched on) with Triton's bundled ptxas and returns the list.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).resolve().parent)


def strides_and_pointers(name: str) -> bool:
    """The arguments a JIT launch sees divisible by 16: pointers and strides (not the block
    table's row stride, which is any width)."""
    return name.endswith("_ptr") or name.startswith("stride") and name != "stride_bt"


def build(kernel: Any, types: Mapping[str, str], consts: Mapping[str, Any],
          divisible: Callable[[str], bool] = strides_and_pointers,
          **options: Any) -> dict[str, Any]:
    """Compile `kernel` for sm_90 with `types` for its arguments (default i32) and `consts`
    for its constexprs; its shared memory and spilled bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    if "PDL" in names and "PDL" not in consts:  # as launched on Hopper: wait and trigger
        consts = {**consts, "PDL": 2}
        options = {"launch_pdl": True, **options}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and divisible(n)}
    compiled = triton.compile(ASTSource(kernel, sig, dict(consts), attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    match = re.search(r"STACK:(\d+)", usage)
    assert match, usage
    return {"kernel": kernel.__name__, "consts": {k: str(v) for k, v in consts.items()},
            "shared": compiled.metadata.shared, "spill": int(match[1]),
            "pdl": "griddepcontrol.wait" in compiled.asm["ptx"],
            "byte_shared_loads": compiled.asm["ptx"].count("ld.shared.b8"),
            "byte_global_loads": compiled.asm["ptx"].count("ld.global.b8"),
            "fp8_cvt": len(re.findall(r"cvt\.rn\.f16x2\.e(?:4m3|5m2)x2", compiled.asm["ptx"])),
            "prmt": compiled.asm["ptx"].count("prmt.b32")}


def compile_launches(script: str, timeout_s: float = 240) -> list[dict[str, Any]]:
    """Run `script` (which imports `build` from this module) without the interpreter and
    return the JSON list its last line prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
