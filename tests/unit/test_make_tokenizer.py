"""loadtest/make_tokenizer.py: a tokenizer of a config's exact vocabulary size, offline.

Built for a small config and for the Llama-3.1-8B-shaped one the GPU benchmarks serve;
both are loaded back the way the services load them (AutoTokenizer from local files, and
meshserve's own loader through resolve_model).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from transformers import AutoTokenizer

from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.shared.model_source import resolve_model

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "loadtest" / "make_tokenizer.py"
LLAMA8B_CONFIG = REPO / "loadtest" / "models" / "llama-3.1-8b" / "config.json"
TEXTS = ["Hello world! The quick brown fox, 12345 jumps over the lazy dog.\n\n",
         "Ünïcödé 你好世界 😀🚀 tabs\tand  double  spaces\r\nend",
         " leading space, 'contractions' they're we'll"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_tokenizer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


make_tokenizer = _script()


def build(tmp: Path, config: dict[str, object]) -> Path:
    config_path = tmp / "source" / "config.json"
    config_path.parent.mkdir(parents=True)
    config_path.write_text(json.dumps(config))
    out = tmp / "model"
    assert make_tokenizer.main(["--config", str(config_path), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama8b") / "model"
    assert make_tokenizer.main(["--config", str(LLAMA8B_CONFIG), "--out", str(out)]) == 0
    return out


def check_folder(out: Path, vocab_size: int, specials: dict[int, str], eos: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert len(tokenizer) == vocab_size
    assert sorted(tokenizer.get_vocab().values()) == list(range(vocab_size))
    assert {i: tokenizer.convert_ids_to_tokens(i) for i in specials} == specials
    assert all(tokenizer.added_tokens_decoder[i].special for i in specials)
    assert tokenizer.eos_token == eos
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < vocab_size for i in ids)
    # Every id decodes to text; the backend's batch decode keeps this fast at 128k ids.
    decoded = tokenizer.backend_tokenizer.decode_batch([[i] for i in range(vocab_size)],
                                                       skip_special_tokens=False)
    assert all(isinstance(text, str) and text for text in decoded)
    assert [decoded[i] for i in specials] == list(specials.values())

    mesh = load_tokenizer(resolve_model(str(out)))
    assert mesh.vocab_size == vocab_size
    assert set(specials) <= mesh.all_special_ids
    ids = mesh.encode(TEXTS[0])
    assert mesh.decode(ids) == TEXTS[0]
    assert ids[0] == next(i for i, name in specials.items() if name == "<|begin_of_text|>")
    chat = mesh.render_chat([{"role": "user", "content": "Hi"}])
    assert chat.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi")
    assert chat.endswith(f"{eos}<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert set(mesh.eos_token_ids) == {i for i, name in specials.items()
                                       if name != "<|begin_of_text|>"}


def test_small_vocabulary(tmp_path: Path) -> None:
    out = build(tmp_path, {"model_type": "llama", "vocab_size": 1000, "bos_token_id": 1,
                           "eos_token_id": 2})
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1000
    check_folder(out, 1000, {1: "<|begin_of_text|>", 2: "<|end_of_text|>"},
                 eos="<|end_of_text|>")


def test_llama_3_1_8b_vocabulary(llama8b: Path) -> None:
    specials = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128008: "<|eom_id|>",
                128009: "<|eot_id|>"}
    check_folder(llama8b, 128256, specials, eos="<|eot_id|>")
    assert (llama8b / "config.json").read_bytes() == LLAMA8B_CONFIG.read_bytes()
    assert json.loads((llama8b / "generation_config.json").read_text())["eos_token_id"] == [
        128001, 128008, 128009]


def test_the_build_is_deterministic(llama8b: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert make_tokenizer.main(["--config", str(LLAMA8B_CONFIG), "--out", str(again)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (again / name).read_bytes() == (llama8b / name).read_bytes(), name


def test_a_config_without_room_for_the_bytes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="256 byte symbols"):
        make_tokenizer.build_tokenizer({"vocab_size": 200, "bos_token_id": 0})
    with pytest.raises(ValueError, match="outside vocab_size"):
        make_tokenizer.build_tokenizer({"vocab_size": 1000, "eos_token_id": [1000]})
