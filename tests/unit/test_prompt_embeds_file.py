"""shared/prompt_embeds.py: `torch.save` files read without torch, element for element, and
what is not a dense float tensor of [rows, hidden] refused with a 400 (nothing else built)."""

from __future__ import annotations

import base64
import io
import os
import pickle
import zipfile

import pytest
import torch

from meshserve.shared import prompt_embeds
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.prompt_embeds import embeds_digest, load_prompt_embeds, load_request_embeds


def _b64(value: object) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("view", ["plain", "transposed", "sliced", "batch_of_one", "grad"])
def test_rows_read_as_torch_lays_them_out(dtype: torch.dtype, view: str) -> None:
    base = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    tensor = {"plain": base[:5], "transposed": base[:8, :5].t(), "sliced": base[3:9, 1:6],
              "batch_of_one": base[None, :4],
              "grad": base[:3].clone().requires_grad_(True) * 2}[view]
    embeds = load_prompt_embeds(_b64(tensor))
    expected = tensor.detach().reshape(embeds.rows, embeds.hidden).contiguous()
    assert (embeds.rows, embeds.hidden) == tuple(expected.shape)
    assert embeds.dtype == str(dtype).removeprefix("torch.")
    assert embeds.data == expected.view(torch.uint8).numpy().tobytes()
    assert embeds.digest == embeds_digest(embeds.dtype, embeds.data)
    assert embeds.last_rows(2).data == expected[-2:].view(torch.uint8).numpy().tobytes()


def test_the_digest_tells_dtypes_and_rows_apart() -> None:
    rows = torch.randn(4, 8)
    digests = {load_prompt_embeds(_b64(t)).digest for t in
               (rows, rows.half(), rows[:3], rows.clone().index_fill_(0, torch.tensor([3]), 0))}
    assert len(digests) == 4
    assert load_prompt_embeds(_b64(rows.clone())).digest == load_prompt_embeds(_b64(rows)).digest


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def _zip_with_pickle(payload: bytes) -> str:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(("encoded", "message"), [
    ("%%%", "not valid base64"),
    (base64.b64encode(b"plain bytes").decode(), "not a tensor saved by torch.save"),
    (_b64({"rows": torch.zeros(2, 2)}), "not a tensor saved by torch.save"),
    (_b64(torch.zeros(5)), "shape [sequence length, hidden size]"),
    (_b64(torch.zeros(2, 3, 4)), "shape [sequence length, hidden size]"),
    (_b64(torch.zeros(0, 4)), "shape [sequence length, hidden size]"),
    (_b64(torch.zeros(3, 4, dtype=torch.int64)), "float32, bfloat16 or float16"),
    (_b64(torch.zeros(3, 4, dtype=torch.float64)), "float32, bfloat16 or float16"),
    (_zip_with_pickle(pickle.dumps(_Evil(), protocol=2)), "is not part of a dense tensor"),
])
def test_refused(encoded: str, message: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        load_prompt_embeds(encoded)
    assert message in refused.value.message
    assert refused.value.param == "prompt_embeds"


def test_a_request_carries_a_bounded_size_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    files = (_b64(torch.zeros(4, 8)), _b64(torch.zeros(4, 8, dtype=torch.float16)))
    assert [e.rows for e in load_request_embeds(files)] == [4, 4]
    monkeypatch.setattr(prompt_embeds, "MAX_REQUEST_BYTES", 4 * 8 * 4 + 4 * 8 * 2 - 1)
    with pytest.raises(InvalidRequestError, match="prompt_embeds hold 192 bytes of rows"):
        load_request_embeds(files)
