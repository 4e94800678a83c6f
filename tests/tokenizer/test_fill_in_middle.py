"""`suffix` (fill-in-the-middle): the prompt is built in the model's FIM tokens, in prefix,
suffix, middle order; a tokenizer without them refuses with a 400 that says why."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer

from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import PromptInput, ServedModel
from meshserve.shared.errors import InvalidRequestError


@pytest.mark.parametrize("tokens", [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                                    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")])
def test_the_prompt_is_prefix_suffix_middle_in_the_models_tokens(tokens: tuple[str, ...]
                                                                 ) -> None:
    hf = build_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": list(tokens)})
    model = ServedModel(Tokenizer(hf), ("m",), 512)
    result = model.tokenize(PromptInput(text="def add(a, b):\n    ", suffix="\n\nprint(1)",
                                        add_special_tokens=False))
    begin, after, middle = tokens
    assert result.text == f"{begin}def add(a, b):\n    {after}\n\nprint(1){middle}"
    ids = [hf.convert_tokens_to_ids(t) for t in tokens]
    assert result.token_ids[0] == ids[0] and result.token_ids[-1] == ids[2]
    assert ids[1] in result.token_ids


def test_a_tokenizer_without_fim_tokens_refuses_suffix() -> None:
    model = ServedModel(Tokenizer(build_tokenizer()), ("m",), 512)
    with pytest.raises(InvalidRequestError, match="fill-in-the-middle") as refused:
        model.tokenize(PromptInput(text="x", suffix="y"))
    assert refused.value.param == "suffix"
    assert model.tokenize(PromptInput(text="x")).text == "x"  # no suffix: as before
