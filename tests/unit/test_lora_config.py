"""PEFT adapter configs, `--lora-modules` values and adapter ids (shared/lora_config.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from meshserve.shared.errors import InvalidRequestError, NotFoundError
from meshserve.shared.lora_config import (
    TARGET_MODULES,
    LoraModule,
    lora_config_from_dict,
    lora_id_for,
    parse_lora_modules,
    read_lora_config,
)


def test_ids_are_stable_hashes_of_the_name() -> None:
    # Fixed across processes and machines (the block hash keys on it): 31 bits of SHA-256.
    assert lora_id_for("sql") == 1321714994
    assert lora_id_for("sql") != lora_id_for("chat")
    assert all(0 < lora_id_for(f"a{i}") < 2**31 for i in range(200))


def test_lora_modules_forms() -> None:
    assert parse_lora_modules(None) == ()
    assert parse_lora_modules("a=/x, b=/y") == (LoraModule("a", "/x"), LoraModule("b", "/y"))
    one = '{"name": "sql", "path": "/s", "base_model_name": "m"}'
    assert parse_lora_modules(one) == (LoraModule("sql", "/s", "m"),)
    mixed = json.dumps([{"name": "sql", "path": "/s"}, "c=/c"])
    assert parse_lora_modules(mixed) == (LoraModule("sql", "/s"), LoraModule("c", "/c"))


@pytest.mark.parametrize("text", ["nopath", "=/x", "a=", '{"name": "a"}', "{bad json",
                                  "a=/x,a=/y"])
def test_bad_lora_modules_are_refused(text: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        parse_lora_modules(text)
    assert refused.value.param == "lora_modules"


def test_config_fields_and_scaling() -> None:
    config = lora_config_from_dict({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                    "target_modules": ["v_proj", "q_proj"], "bias": "none"})
    assert (config.rank, config.scaling, config.target_modules) == (8, 2.0,
                                                                     ("q_proj", "v_proj"))
    rs = lora_config_from_dict({"r": 16, "lora_alpha": 8, "use_rslora": True,
                                "target_modules": "all-linear"})
    assert rs.scaling == pytest.approx(8 / math.sqrt(16)) and rs.target_modules == TARGET_MODULES


@pytest.mark.parametrize(("raw", "says"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["embed_tokens"]}, "embed_tokens"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"bias": "all"}, "bias"),
    ({"r": 0}, "positive"),
    ({"peft_type": "IA3"}, "IA3"),
    ({"target_modules": ".*proj"}, "pattern"),
])
def test_unsupported_adapters_are_refused_by_name(raw: dict, says: str) -> None:
    base = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    with pytest.raises(InvalidRequestError, match=says) as refused:
        lora_config_from_dict({**base, **raw})
    assert refused.value.param == "lora_path"


def test_a_missing_folder_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="adapter_config.json"):
        read_lora_config(tmp_path / "none")
