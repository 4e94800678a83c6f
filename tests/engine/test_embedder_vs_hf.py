"""Pooled vectors of the embedder against transformers on the same tiny random weights.

The reference is transformers' AutoModel (the decoder without its LM head): its
last_hidden_state is the final norm's output, pooled here by hand per input (no padding,
one input at a time), then truncated and L2-normalised. Ours run every input of a batch
in one flat forward through the engine's attention path.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.pooling.batcher import EmbedBatcher
from meshserve.services.worker.pooling.embedder import Embedder
from meshserve.services.worker.pooling.pooler import finish
from meshserve.shared.errors import ContextLengthError

# Different lengths, one of a single token, one past a 16-token block.
INPUTS = [[5, 6, 7, 8, 9, 10, 11], [3], list(range(100, 133)), [40, 41, 42, 43]]
TOLERANCE = 1e-4


def _reference(model_dir: Path, inputs: list[list[int]], pooling: str,
               dimensions: int | None = None) -> torch.Tensor:
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in inputs:
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]  # [L, H]
            rows.append(hidden[-1] if pooling == "LAST" else hidden.mean(0))
    pooled = torch.stack(rows)  # [B, H]
    if dimensions is not None:
        pooled = pooled[:, :dimensions]
    return F.normalize(pooled, dim=-1)


def _embedder(model_dir: Path, pooler_config: str | None = None, **options: object) -> Embedder:
    return Embedder(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                 **options),  # type: ignore[arg-type]
                    pooler_config)


@pytest.mark.parametrize("arch_fixture", ["tiny_qwen3_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_a_batch_pools_as_transformers_does(request: pytest.FixtureRequest, arch_fixture: str,
                                            pooling: str) -> None:
    model_dir = request.getfixturevalue(arch_fixture)
    override = None if pooling == "LAST" else '{"pooling_type": "MEAN"}'
    embedder = _embedder(model_dir, override)
    assert embedder.pooler.pooling_type == pooling and embedder.pooler.normalize
    ours = finish(embedder.embed(INPUTS), embedder.hidden_size, True)  # one forward
    expected = _reference(model_dir, INPUTS, pooling)
    assert ours.shape == expected.shape == (len(INPUTS), 64)
    assert torch.allclose(ours, expected, atol=TOLERANCE, rtol=0), (
        (ours - expected).abs().max().item())
    # Pooling really differs between inputs and between the two kinds.
    assert not torch.allclose(ours[0], ours[3], atol=1e-2)


def test_matryoshka_truncates_before_normalising(tiny_qwen3_dir: Path) -> None:
    embedder = _embedder(tiny_qwen3_dir)
    ours = finish(embedder.embed(INPUTS), 16, True)
    expected = _reference(tiny_qwen3_dir, INPUTS, "LAST", dimensions=16)
    assert torch.allclose(ours, expected, atol=TOLERANCE, rtol=0)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(INPUTS)), atol=1e-5)
    raw = finish(embedder.embed(INPUTS), 64, False)
    assert not torch.allclose(raw.norm(dim=-1), torch.ones(len(INPUTS)), atol=1e-2)


def test_a_sentence_transformers_folder_sets_the_pooling(tmp_path: Path,
                                                         tiny_qwen3_dir: Path) -> None:
    """Qwen3-Embedding's layout: the bare decoder's weights (no `model.` prefix, no LM head)
    beside modules.json and 1_Pooling/config.json, here asking for mean pooling."""
    folder = tmp_path / "st"
    AutoModel.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    embedder = _embedder(folder)
    assert (embedder.pooler.pooling_type, embedder.pooler.normalize) == ("MEAN", True)
    assert embedder.pooler.source == "sentence-transformers"
    ours = finish(embedder.embed(INPUTS), 64, True)
    assert torch.allclose(ours, _reference(tiny_qwen3_dir, INPUTS, "MEAN"), atol=TOLERANCE,
                          rtol=0)
    # --pooler-config wins over the folder's files.
    forced = _embedder(folder, '{"pooling_type": "LAST", "normalize": false}')
    assert (forced.pooler.pooling_type, forced.pooler.normalize) == ("LAST", False)


def test_too_long_inputs_are_refused(tiny_qwen3_dir: Path) -> None:
    embedder = _embedder(tiny_qwen3_dir, max_model_len=20)
    embedder.check_input(list(range(20)), 0)
    with pytest.raises(ContextLengthError, match="maximum context length is 20 tokens"):
        embedder.check_input(list(range(21)), 0)


def test_the_batcher_spreads_calls_over_forwards_and_gathers_them_back(
        tiny_qwen3_dir: Path) -> None:
    """A token budget of 40: the calls' 11 inputs need several forwards, most of which carry
    inputs of more than one call; every call still gets exactly its own vectors."""
    embedder = _embedder(tiny_qwen3_dir, max_num_batched_tokens=40, max_model_len=40)
    calls = [INPUTS, [[7, 8, 9]] * 3, INPUTS[::-1]]
    expected = [finish(embedder.embed([ids]), 32, True)[0] for call in calls for ids in call]

    async def run() -> list[bytes]:
        batcher = EmbedBatcher(embedder)
        batcher.start()
        futures = [batcher.submit(call, dimensions=32, normalize=True) for call in calls]
        results = await asyncio.gather(*futures)
        batcher.stop()
        await batcher.wait_stopped()
        assert batcher.forwards >= 3, batcher.forwards
        assert [r.num_tokens for r in results] == [sum(map(len, c)) for c in calls]
        return [r.vectors for r in results]

    vectors = asyncio.run(run())
    got = torch.cat([torch.frombuffer(bytearray(v), dtype=torch.float32).view(-1, 32)
                     for v in vectors])
    assert torch.allclose(got, torch.stack(expected), atol=TOLERANCE, rtol=0)
