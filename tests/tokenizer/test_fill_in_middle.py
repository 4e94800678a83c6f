"""`suffix` (fill-in-the-middle): the prompt is built in the model's FIM tokens, in prefix,
suffix, middle order; a tokenizer without them refuses with a 400 that says why."""

from __future__ import annotations

import json

import pytest
from tiny_models import build_tokenizer
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import PromptInput, ServedModel
from meshserve.shared.errors import InvalidRequestError

SPELLINGS = [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
             ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
              "<\uff5cfim\u2581end\uff5c>")]


def with_tokens(tokens: list[str], special: bool = True) -> PreTrainedTokenizerFast:
    hf = build_tokenizer()
    if special:
        hf.add_special_tokens({"additional_special_tokens": tokens})
    else:
        hf.add_tokens(tokens)
    return hf


@pytest.mark.parametrize("tokens", SPELLINGS)
@pytest.mark.parametrize("special", [True, False])
def test_the_prompt_is_prefix_suffix_middle_in_the_models_tokens(tokens: tuple[str, ...],
                                                                 special: bool) -> None:
    hf = with_tokens(list(tokens), special)
    model = ServedModel(Tokenizer(hf), ("m",), 512)
    result = model.tokenize(PromptInput(text="def add(a, b):\n    ", suffix="\n\nprint(1)",
                                        add_special_tokens=False))
    begin, after, middle = tokens
    assert result.text == f"{begin}def add(a, b):\n    {after}\n\nprint(1){middle}"
    ids = [hf.convert_tokens_to_ids(t) for t in tokens]
    assert result.token_ids == [ids[0], *hf.encode("def add(a, b):\n    ",
                                                   add_special_tokens=False),
                                ids[1], *hf.encode("\n\nprint(1)", add_special_tokens=False),
                                ids[2]]


def test_a_tokenizer_without_fim_tokens_refuses_suffix() -> None:
    model = ServedModel(Tokenizer(build_tokenizer()), ("m",), 512)
    with pytest.raises(InvalidRequestError) as refused:
        model.tokenize(PromptInput(text="x", suffix="y"))
    assert refused.value.param == "suffix"
    assert "the model's tokenizer has no fill-in-the-middle tokens" in refused.value.message
    assert model.tokenize(PromptInput(text="x")).text == "x"  # no suffix: as before


def test_two_of_three_tokens_are_not_enough() -> None:
    tokenizer = Tokenizer(with_tokens(["<fim_prefix>", "<fim_suffix>"]))
    assert tokenizer.fim_tokens is None


def test_names_in_the_vocabulary_that_the_encoder_splits_do_not_count() -> None:
    """Vocabulary entries without merges that make them: encoding never yields them."""
    data = json.loads(build_tokenizer().backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for token in SPELLINGS[0]:
        vocab[token] = len(vocab)
    hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(data)))
    assert "<fim_prefix>" in hf.get_vocab()
    assert len(hf.encode("<fim_prefix>", add_special_tokens=False)) > 1
    assert Tokenizer(hf).fim_tokens is None


def test_truncation_that_would_cut_the_fim_prefix_is_refused() -> None:
    model = ServedModel(Tokenizer(with_tokens(list(SPELLINGS[0]))), ("m",), 512)
    whole = model.tokenize(PromptInput(text="abc", suffix="xyz", add_special_tokens=False))
    kept = model.tokenize(PromptInput(text="abc", suffix="xyz", add_special_tokens=False,
                                      truncate_prompt_tokens=len(whole.token_ids)))
    assert kept.token_ids == whole.token_ids
    with pytest.raises(InvalidRequestError) as refused:
        model.tokenize(PromptInput(text="abc", suffix="xyz", add_special_tokens=False,
                                   truncate_prompt_tokens=len(whole.token_ids) - 1))
    assert refused.value.param == "truncate_prompt_tokens"
