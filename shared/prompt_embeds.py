"""Prompt embeddings (`prompt_embeds` on /v1/completions) read without torch.

A client sends each prompt as a base64 string of a `torch.save`d tensor [rows, hidden]
(float32, bfloat16 or float16; a leading batch dimension of 1 is dropped, as vLLM does).
The gateway reads the file here: the zip archive's pickle is replayed by an unpickler that
knows only what a saved dense tensor needs (no other class is ever built), and the storage
bytes are laid out row-major. The worker takes the rows in place of the token embeddings of
as many placeholder tokens; their `digest` keys the prefix cache's blocks (shared/block_hash.py
ImageSpan), so that two different tensors never share KV.
"""

from __future__ import annotations

import binascii
import hashlib
import io
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import numpy as np

from meshserve.shared.errors import InvalidRequestError

# Element types accepted, by the storage class torch pickles: (wire name, bytes, numpy
# type with the same layout; bfloat16 is moved as its raw 16-bit words).
_STORAGES: dict[str, tuple[str, int, Any]] = {
    "FloatStorage": ("float32", 4, np.float32),
    "BFloat16Storage": ("bfloat16", 2, np.uint16),
    "HalfStorage": ("float16", 2, np.float16),
}
DTYPE_SIZES = {name: size for name, size, _ in _STORAGES.values()}
"""Bytes of one element of each accepted dtype, by wire name."""
_PARAM = "prompt_embeds"
DISABLED_MESSAGE = "You must set `--enable-prompt-embeds` to input `prompt_embeds`."
"""vLLM's refusal of prompt_embeds when the server runs without the flag."""
MAX_REQUEST_BYTES = 32 * 1024 * 1024
"""Most bytes of rows one request carries to a worker: its add travels in one Session
message (64 MiB at most), possibly beside others. The HTTP body limit (8 MiB by default)
keeps requests far below it unless raised."""


@dataclass(frozen=True)
class PromptEmbeds:
    """One prompt's embeddings: `rows` x `hidden` elements of `dtype`, row-major,
    little-endian, in `data`."""

    data: bytes
    dtype: str  # float32, bfloat16 or float16
    rows: int
    hidden: int

    @cached_property
    def digest(self) -> bytes:
        return embeds_digest(self.dtype, self.data)

    def last_rows(self, keep: int) -> PromptEmbeds:
        """Only the last `keep` rows (truncate_prompt_tokens)."""
        if keep >= self.rows:
            return self
        row_bytes = len(self.data) // self.rows
        return PromptEmbeds(self.data[-keep * row_bytes:], self.dtype, keep, self.hidden)


def load_request_embeds(encoded: tuple[str, ...]) -> tuple[PromptEmbeds, ...]:
    """Every prompt_embeds of a request read, within MAX_REQUEST_BYTES in all."""
    loaded = tuple(load_prompt_embeds(e, i) for i, e in enumerate(encoded))
    size = sum(len(e.data) for e in loaded)
    if size > MAX_REQUEST_BYTES:
        raise InvalidRequestError(f"prompt_embeds hold {size} bytes of rows; a request may "
                                  f"carry at most {MAX_REQUEST_BYTES}", param=_PARAM)
    return loaded


def embeds_digest(dtype: str, data: bytes) -> bytes:
    """The embeddings' identity in the prefix cache (SHA-256 over their dtype and bytes)."""
    return hashlib.sha256(b"meshserve/prompt-embeds/" + dtype.encode() + b"/" + data).digest()


@dataclass(frozen=True)
class _Storage:
    """A storage the pickle refers to: its element type and its key in the archive."""

    kind: str
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: object, offset: int, size: tuple[int, ...],
                    stride: tuple[int, ...], *_ignored: object) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    return _Tensor(storage, int(offset), tuple(int(s) for s in size),
                   tuple(int(s) for s in stride))


def _rebuild_parameter(data: object, *_ignored: object) -> object:
    return data


class _TensorUnpickler(pickle.Unpickler):
    """Replays a saved tensor's pickle, building nothing but `_Tensor` and `_Storage`."""

    _GLOBALS: ClassVar[dict[tuple[str, str], Any]] = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("collections", "OrderedDict"): OrderedDict}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name.endswith("Storage"):
            return name  # the storage's kind, read by persistent_load
        found = self._GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a dense tensor")
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("an unknown persistent object")
        kind, key, numel = pid[1], pid[2], pid[4]
        if kind not in _STORAGES:
            raise InvalidRequestError(
                f"prompt_embeds must be float32, bfloat16 or float16 (got a {kind})",
                param=_PARAM)
        return _Storage(kind, str(key), int(numel))


def load_prompt_embeds(encoded: str, index: int = 0) -> PromptEmbeds:
    """Read one base64 `torch.save` file; InvalidRequestError (400) unless it holds one
    dense float32/bfloat16/float16 tensor of 2 dimensions (or 3 with a batch of 1)."""
    where = f"prompt_embeds[{index}]"
    try:
        raw = binascii.a2b_base64(encoded.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        raise InvalidRequestError(f"{where} is not valid base64", param=_PARAM) from None
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        pkl = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
        tensor = _TensorUnpickler(io.BytesIO(archive.read(pkl))).load()
        prefix = pkl.removesuffix("data.pkl")
        if not isinstance(tensor, _Tensor):
            raise pickle.UnpicklingError("the file holds no tensor")
        storage = archive.read(f"{prefix}data/{tensor.storage.key}")
    except InvalidRequestError:
        raise
    except (zipfile.BadZipFile, StopIteration, KeyError, pickle.UnpicklingError, EOFError,
            ValueError, TypeError, AttributeError, IndexError) as exc:
        raise InvalidRequestError(f"{where} is not a tensor saved by torch.save ({exc})",
                                  param=_PARAM) from None
    return _row_major(tensor, storage, where)


def _row_major(tensor: _Tensor, storage: bytes, where: str) -> PromptEmbeds:
    """The tensor's elements in row-major order, its shape checked."""
    size, stride = tensor.size, tensor.stride
    if len(size) == 3 and size[0] == 1:  # a batch of one
        size, stride = size[1:], stride[1:]
    if len(size) != 2 or size[0] < 1 or size[1] < 1:
        raise InvalidRequestError(
            f"{where} must have the shape [sequence length, hidden size] (got "
            f"{list(tensor.size)})", param=_PARAM)
    dtype, width, np_type = _STORAGES[tensor.storage.kind]
    elements = np.frombuffer(storage, dtype=np_type)
    last = tensor.offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if tensor.offset < 0 or min(stride) < 0 or last >= elements.size:
        raise InvalidRequestError(f"{where}: the tensor's view lies outside its storage",
                                  param=_PARAM)
    view = np.lib.stride_tricks.as_strided(
        elements[tensor.offset:], shape=size, strides=[s * width for s in stride],
        writeable=False)
    data = np.ascontiguousarray(view).astype(np.dtype(np_type).newbyteorder("<")).tobytes()
    return PromptEmbeds(data, dtype, size[0], size[1])
