"""Element types of KV blocks as the kvstore and the workers name them, and their sizes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType

KV_DTYPE_BYTES = MappingProxyType({
    "float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
})
"""Element size of each KV dtype the store accepts, in bytes (names as torch spells them)."""


def block_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a C-contiguous block of `shape` in `dtype` (KeyError for an unknown dtype)."""
    return math.prod(shape) * KV_DTYPE_BYTES[dtype]


KV_CACHE_DTYPES = MappingProxyType({
    "auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
})
"""`--kv-cache-dtype` values (vLLM's spellings) -> the cache's element type (None: the model's)."""


def kv_cache_dtype_name(option: str, model_dtype: str) -> str:
    """The KV cache element type for `--kv-cache-dtype option` on a model in `model_dtype`."""
    if option not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {option!r}")
    return KV_CACHE_DTYPES[option] or model_dtype
