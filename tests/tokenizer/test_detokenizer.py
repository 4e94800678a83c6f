"""Incremental detokenizer, stop strings, the combined text stream, and the tokenizer.

The reference throughout is `Tokenizer.decode` of all ids at once (which is the
Rust tokenizer's own decode) and Python's `str.find` on the full text.
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from meshserve.services.tokenizer.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopChecker,
    TextStream,
)
from meshserve.services.tokenizer.loader import Tokenizer, load_tokenizer, normalize_messages
from meshserve.shared.errors import InvalidRequestError, ModelLoadError
from meshserve.shared.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "你好，世界！今天天气很好。東京と大阪",
    "Emoji time 😀🎉👍🏽 and more 🚀✨ naïve café",
    "The quick brown fox jumps over the lazy dog. STOP here.",
]
SAMPLE = ("Hello 世界! 😀🎉👍🏽 naïve café — the fox.<|im_end|>東京 🚀✨ "
          "<|im_start|>done 你好")


def build_byte_level_tokenizer(folder: Path) -> Path:
    """A byte-level BPE (GPT-2/Llama-3 style) with ChatML specials, saved as an HF folder.

    The vocabulary is small, so CJK characters and emoji split into several tokens.
    """
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rust.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(folder)
    return folder


def build_sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2 style tokenizer: '▁' word marks, byte fallback, and a decoder that strips
    the leading space of the text, so decoding depends on context."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in ["▁", *string.ascii_letters, *string.digits, *".,!?"]:
        vocab[ch] = len(vocab)
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r"), ("▁w", "or"),
              ("l", "d"), ("▁wor", "ld")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                    byte_fallback=True))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    rust.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    return Tokenizer(hf, name="sp-tiny")


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(build_byte_level_tokenizer(tmp_path_factory.mktemp("bytebpe")))


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    return build_sentencepiece_tokenizer()


def sample_ids(tok: Tokenizer) -> list[int]:
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    # Precondition of the tests: some character spans several tokens.
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)
    return ids


def random_chunks(ids: Sequence[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 6)
        chunks.append(list(ids[i:i + size]))
        i += size
    return chunks


def stream_text(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.feed(chunk) for chunk in chunks] + [detok.flush()]


# -- IncrementalDetokenizer -------------------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("which", ["byte_tok", "sp_tok"])
def test_chunked_decoding_reproduces_full_decode(which: str, skip: bool, spaces: bool,
                                                 request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    ids = sample_ids(tok)
    if which == "sp_tok":
        ids = ids + [2] + tok.encode("the world", add_special_tokens=False) + [2, 2]
    else:
        ids = ids + [2, 0] + tok.encode(" the fox", add_special_tokens=False)
    reference = tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    rng = random.Random(1234)
    chunkings = [[[i] for i in ids], [ids]] + [random_chunks(ids, rng) for _ in range(60)]
    for chunks in chunkings:
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip,
                                       spaces_between_special_tokens=spaces)
        pieces = stream_text(detok, chunks)
        assert "".join(pieces) == reference
        # The sample is made of complete characters: no piece may carry a broken one.
        assert not any(REPLACEMENT_CHAR in piece for piece in pieces)


def test_special_token_options_are_honoured(sp_tok: Tokenizer, byte_tok: Tokenizer) -> None:
    ids = sp_tok.encode("hello", add_special_tokens=False) + [2] + sp_tok.encode(
        "world", add_special_tokens=False)
    assert sp_tok.decode(ids, skip_special_tokens=True) == "hello world"
    # The Rust decoder's own spacing, as a full decode gives it ...
    assert sp_tok.decode(ids, False, True) == sp_tok.hf.decode(ids, skip_special_tokens=False)
    # ... and with spaces_between_special_tokens=False, nothing around added tokens.
    assert sp_tok.decode(ids, False, False) == "hello</s>world"
    im_end = byte_tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" not in byte_tok.decode([im_end], skip_special_tokens=True)
    assert byte_tok.decode([im_end], skip_special_tokens=False) == "<|im_end|>"


def test_incomplete_character_is_held_back(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("ab😀", add_special_tokens=False)
    emoji_ids = byte_tok.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) >= 2 and ids[-len(emoji_ids):] == emoji_ids  # precondition
    detok = IncrementalDetokenizer(byte_tok)
    first = detok.feed(ids[:-1])
    assert first == byte_tok.decode(ids[:-len(emoji_ids)])  # text before the emoji only
    assert detok.num_pending_tokens >= 1
    assert detok.feed(ids[-1:]) == "😀"
    assert detok.num_pending_tokens == 0


def test_flush_emits_a_broken_tail_as_decode_does(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("ok 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(byte_tok)
    assert "".join(stream_text(detok, [[i] for i in ids])) == byte_tok.decode(ids)
    assert byte_tok.decode(ids).endswith(REPLACEMENT_CHAR)


def test_prompt_context_keeps_a_leading_space(sp_tok: Tokenizer) -> None:
    prompt = sp_tok.encode("say", add_special_tokens=False)
    output = sp_tok.encode("the world", add_special_tokens=False)
    alone = IncrementalDetokenizer(sp_tok)
    assert "".join(stream_text(alone, [[i] for i in output])) == sp_tok.decode(output)
    with_prompt = IncrementalDetokenizer(sp_tok, prompt_token_ids=prompt)
    full = sp_tok.decode(prompt + output)
    expected = full[len(sp_tok.decode(prompt)):]
    assert expected.startswith(" ")  # what a continuation of the prompt looks like
    assert "".join(stream_text(with_prompt, [[i] for i in output])) == expected


class CountingDecoder:
    """Records how many ids each decode call is given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        self.sizes.append(len(token_ids))
        return self.tok.decode(token_ids, skip_special_tokens, spaces_between_special_tokens)


def test_work_per_call_does_not_grow_with_output_length(byte_tok: Tokenizer) -> None:
    ids = sample_ids(byte_tok) * 40
    counter = CountingDecoder(byte_tok)
    detok = IncrementalDetokenizer(counter)
    text = "".join(stream_text(detok, [[i] for i in ids]))
    assert text == byte_tok.decode(ids)
    assert len(ids) > 500
    # A window never spans more than a few tokens: no call re-decodes the whole output.
    assert max(counter.sizes) <= 10
    assert len(counter.sizes) <= 4 * len(ids)


# -- StopChecker --------------------------------------------------------------------------------

def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Reference: scan end positions; the first one where a stop string ends wins,
    the longest of those that end there (it starts first)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            best = max(hits, key=len)
            return end - len(best), best
    return None


def run_checker(checker: StopChecker, chunks: Sequence[str]) -> tuple[str, bool, str | None]:
    out, stopped, reason = [], False, None
    for i, chunk in enumerate(chunks):
        match = checker.feed(chunk, final=i == len(chunks) - 1)
        out.append(match.text)
        stopped = stopped or match.stopped
        reason = match.stop_str if match.stop_str is not None else reason
    return "".join(out), stopped, reason


def split_text(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stops", [["STOP"], ["world", "llo"], ["bcd", "abcde"],
                                   ["ab", "abc"], ["zzz"], ["好", "😀🎉"]])
def test_stop_strings_in_any_chunking(stops: list[str], include: bool) -> None:
    texts = ["hello world STOP after", "xabcdefg", "naïve 你好 😀🎉 done", "no match at all"]
    rng = random.Random(7)
    for text in texts:
        hit = first_stop(text, stops)
        if hit is None:
            expected = text
        else:
            expected = text[:hit[0] + len(hit[1])] if include else text[:hit[0]]
        for _ in range(40):
            got = run_checker(StopChecker(stops, include), split_text(text, rng))
            assert got == (expected, hit is not None, hit[1] if hit else None)


def test_stop_checker_holds_back_only_a_possible_stop_prefix() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST").text == "abc "
    assert checker.feed("AR").text == "STAR"
    assert checker.feed("xyz").text == "xyz"
    assert checker.feed("S").text == ""
    assert checker.feed("", final=True).text == "S"


def test_nothing_after_a_stop_string_is_emitted() -> None:
    checker = StopChecker(["<end>"])
    first = checker.feed("answer<en")
    second = checker.feed("d>tail")
    third = checker.feed("more", final=True)
    assert (first.text, second.text, second.stopped, second.stop_str) == (
        "answer", "", True, "<end>")
    assert third.text == "" and checker.stopped


# -- TextStream -------------------------------------------------------------------------------

def run_stream(stream: TextStream, chunks: list[list[int]]) -> tuple[str, bool, str | None]:
    out, stopped, reason = [], False, None
    for i, chunk in enumerate(chunks):
        delta = stream.feed(chunk, finished=i == len(chunks) - 1)
        out.append(delta.text)
        stopped, reason = delta.stopped, delta.stop_reason
    return "".join(out), stopped, reason


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(byte_tok: Tokenizer, include: bool) -> None:
    ids = sample_ids(byte_tok)
    full = byte_tok.decode(ids)
    stop = "😀🎉"
    start = full.index(stop)
    expected = full[:start + len(stop)] if include else full[:start]
    params = SamplingParams(stop=(stop, "never"), include_stop_str_in_output=include)
    rng = random.Random(3)
    for chunks in [[[i] for i in ids]] + [random_chunks(ids, rng) for _ in range(30)]:
        text, stopped, reason = run_stream(TextStream(byte_tok, params), chunks)
        assert (text, stopped, reason) == (expected, True, stop)


def test_stream_without_stop_reproduces_decode(byte_tok: Tokenizer) -> None:
    ids = sample_ids(byte_tok)
    params = SamplingParams(skip_special_tokens=False)
    text, stopped, _ = run_stream(TextStream(byte_tok, params), [[i] for i in ids])
    assert (text, stopped) == (byte_tok.decode(ids, skip_special_tokens=False), False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_dropped_unless_included(byte_tok: Tokenizer, include: bool) -> None:
    ids = byte_tok.encode("the fox", add_special_tokens=False)
    eos = byte_tok.eos_token_ids[0]
    params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
    stream = TextStream(byte_tok, params)
    text = stream.feed(ids).text + stream.feed([eos], finished=True, stopped_on_token=True).text
    assert text == byte_tok.decode(ids + [eos] if include else ids, skip_special_tokens=False)


def test_stop_strings_wait_for_min_tokens(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("the fox. the fox. the end", add_special_tokens=False)
    first_fox = byte_tok.encode("the fox", add_special_tokens=False)
    params = SamplingParams(stop=("fox",), min_tokens=len(first_fox) + 1, max_tokens=64)
    text, stopped, _ = run_stream(TextStream(byte_tok, params), [[i] for i in ids])
    assert stopped and text == "the fox. the "


def test_stream_is_closed_after_the_stop(byte_tok: Tokenizer) -> None:
    stream = TextStream(byte_tok, SamplingParams(stop=("fox",)))
    ids = byte_tok.encode("the fox jumps", add_special_tokens=False)
    first = stream.feed(ids)
    later = stream.feed(byte_tok.encode(" again", add_special_tokens=False), finished=True)
    assert (first.text, first.stopped, later.text, later.stopped) == ("the ", True, "", True)


# -- Tokenizer: loading, chat templates, token metadata ---------------------------------------

def write_gguf_tokenizer(folder: Path, target: Path) -> Path:
    """The byte-level tokenizer of `folder` as a GGUF file (metadata only, as llama.cpp
    stores a GPT-2 style tokenizer)."""
    import gguf
    data = orjson.loads((folder / "tokenizer.json").read_bytes())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    added = {a["id"] for a in data["added_tokens"]}
    writer = gguf.GGUFWriter(str(target), "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 2)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                             for m in data["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template((folder / "chat_template.jinja").read_text())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_load_from_folder_source_object_and_gguf(tmp_path: Path) -> None:
    folder = build_byte_level_tokenizer(tmp_path / "model")
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    from_path = load_tokenizer(str(folder))
    source = SimpleNamespace(name="tiny", path=folder, format="hf", gguf_file=None)
    from_source = load_tokenizer(source)
    gguf_file = write_gguf_tokenizer(folder, tmp_path / "tiny.gguf")
    from_gguf = load_tokenizer(SimpleNamespace(name="g", path=gguf_file, format="gguf",
                                               gguf_file=gguf_file))
    im_end = from_path.hf.convert_tokens_to_ids("<|im_end|>")
    assert from_path.eos_token_ids == (im_end, 0)  # tokenizer EOS, then generation config's
    assert from_source.name == "tiny" and from_gguf.eos_token_ids == (im_end,)
    assert from_path.vocab_size == len(from_path.hf) == from_gguf.vocab_size
    assert from_path.model_max_length is None
    assert {im_end, 0} <= from_path.all_special_ids
    ids = from_path.encode(SAMPLE, add_special_tokens=False)
    assert from_gguf.encode(SAMPLE, add_special_tokens=False) == ids
    assert from_gguf.decode(ids, skip_special_tokens=False) == SAMPLE
    messages = [{"role": "user", "content": "hi 你好"}]
    assert from_gguf.render_chat(messages) == from_path.render_chat(messages)


def test_missing_model_path_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_tokenizer(tmp_path / "weights.bin")


def test_chat_template_rendering(byte_tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "text", "text": "😀"}]}]
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi\n😀<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert byte_tok.render_chat(messages) == expected
    assert byte_tok.apply_chat_template(messages) == byte_tok.encode(
        expected, add_special_tokens=False)
    assert byte_tok.render_chat(messages, add_generation_prompt=False) == expected[:-len(
        "<|im_start|>assistant\n")]


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"),
    ("hello", "messages"),
    (["hello"], "messages"),
    ([{"role": 7, "content": "x"}], "messages[0].role"),  # any string role passes
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
     "messages[1].content"),
])
def test_malformed_messages_are_rejected(byte_tok: Tokenizer, messages: object,
                                         param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        byte_tok.apply_chat_template(messages)
    assert info.value.param == param


def test_chat_without_template_and_reserved_kwargs(byte_tok: Tokenizer,
                                                   sp_tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="no chat template"):
        sp_tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError) as info:
        byte_tok.render_chat([{"role": "user", "content": "hi"}],
                             chat_template_kwargs={"tokenize": True})
    assert info.value.param == "chat_template_kwargs"


def test_tool_call_arguments_become_objects() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": '{"x": 1}'}}]
    out = normalize_messages([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert calls[0]["function"]["arguments"] == '{"x": 1}'  # the input is not changed
    assert out[0]["content"] == ""


def test_token_bytes_rebuild_the_utf8_text(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("Hello 世界! 😀🎉 naïve", add_special_tokens=False)
    assert b"".join(byte_tok.token_bytes(i) for i in ids) == "Hello 世界! 😀🎉 naïve".encode()
    assert [byte_tok.token_text(i) for i in ids] == [byte_tok.decode([i]) for i in ids]
    im_end = byte_tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert byte_tok.token_bytes(im_end) == b"<|im_end|>"
    sp = build_sentencepiece_tokenizer()
    fallback = sp.encode("你", add_special_tokens=False)
    assert b"".join(sp.token_bytes(i) for i in fallback).endswith("你".encode())


def test_template_kwargs_tools_and_template_errors(tmp_path: Path) -> None:
    tok = load_tokenizer(build_byte_level_tokenizer(tmp_path / "model"))
    tok.hf.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }};{% endfor %}"
        "{% if tools %}tools={{ tools | map(attribute='function.name') | join(',') }};{% endif %}"
        "{% if flag %}flag;{% endif %}")
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    text = tok.render_chat([{"role": "user", "content": "q"}], tools=tools,
                           chat_template_kwargs={"flag": True})
    assert text == "q;tools=lookup;flag;"
    with pytest.raises(InvalidRequestError, match="first turn must be user") as info:
        tok.render_chat([{"role": "assistant", "content": "a"}])
    assert info.value.param == "messages"
