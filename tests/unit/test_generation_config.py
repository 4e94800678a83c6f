"""Sampling defaults from generation_config.json, as --generation-config auto|vllm|FOLDER
and --override-generation-config read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshserve.shared.errors import ModelLoadError
from meshserve.shared.generation_config import apply_defaults, sampling_defaults


def folder_with(tmp_path: Path, name: str, config: dict[str, object]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_sampling_fields_of_the_model(tmp_path: Path) -> None:
    model = folder_with(tmp_path, "m", {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                        "do_sample": True, "eos_token_id": [1, 2],
                                        "max_new_tokens": 64, "repetition_penalty": 1.1})
    assert sampling_defaults(model) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                        "repetition_penalty": 1.1, "max_tokens": 64}
    assert sampling_defaults(model, "vllm") == {}
    other = folder_with(tmp_path, "other", {"temperature": 0.2})
    assert sampling_defaults(model, str(other)) == {"temperature": 0.2}
    assert sampling_defaults(model, "auto", '{"temperature": 1.0, "min_p": 0.1}') == {
        "temperature": 1.0, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
        "max_tokens": 64, "min_p": 0.1}
    assert sampling_defaults(tmp_path / "none") == {}


@pytest.mark.parametrize(("mode", "override"), [("/no/such/folder", None), ("auto", "[1]"),
                                                ("auto", "{not json")])
def test_bad_settings_are_refused(tmp_path: Path, mode: str, override: str | None) -> None:
    with pytest.raises(ModelLoadError):
        sampling_defaults(tmp_path, mode, override)


def test_defaults_fill_only_what_the_body_leaves_out() -> None:
    defaults = {"temperature": 0.0, "top_k": 5, "max_tokens": 9}
    assert apply_defaults({"temperature": 0.7, "top_k": None}, defaults) == {
        "temperature": 0.7, "top_k": 5}
    body = {"model": "m"}
    assert apply_defaults(body, {}) is body
