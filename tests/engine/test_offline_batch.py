"""OfflineLLM over a scripted fake engine, and run_batch over OpenAI batch files.

The fake engine has the LLMEngine call surface and emits scripted token ids a few
per step, so multi-byte characters split across steps. Expected texts come from
the tokenizer's full decode and Python string operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from meshserve.offline.llm import GenerationItem, OfflineLLM
from meshserve.offline.run_batch import run_batch
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.worker.engine.sequence import SequenceOutput
from meshserve.shared.errors import ContextLengthError, InternalError, InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import SamplingParams

REPLIES = ("Sure! 你好 😀🎉 the fox STOP and more text", "Other 東京 🚀✨ reply, no stop here")
MAX_MODEL_LEN = 48
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer() -> Tokenizer:
    """A small byte-level BPE with ChatML specials; CJK and emoji split into several tokens."""
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rust.train_from_iterator([*REPLIES, "Say hi to the quick brown fox", "user assistant"] * 4,
                             trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return Tokenizer(hf, name="tiny")


@dataclass
class FakeSeq:
    chunks: list[list[int]]
    pos: int = 0
    done: bool = False


@dataclass
class FakeRequest:
    prompt: list[int]
    params: SamplingParams
    seqs: list[FakeSeq]
    aborted: bool = False
    sent_prompt_logprobs: bool = False


@dataclass
class FakeEngine:
    """Replies REPLIES[index] + EOS to every prompt, `chunk` tokens a step."""

    tokenizer: Tokenizer
    chunk: int = 2
    lose_requests: bool = False  # simulate an engine bug: drop requests silently
    requests: dict[str, FakeRequest] = field(default_factory=dict)
    added: list[tuple[str, list[int], int, str | None]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN,
                                            vocab_size=self.tokenizer.vocab_size,
                                            eos_token_ids=self.tokenizer.eos_token_ids)

    def reply_ids(self, index: int, params: SamplingParams) -> list[int]:
        ids = self.tokenizer.encode(REPLIES[index % 2], add_special_tokens=False)
        ids.append(self.tokenizer.eos_token_ids[0])
        return ids if params.max_tokens is None else ids[:params.max_tokens]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, priority: int = 0, cache_salt: str | None = None,
                    lora_id: int | None = None, images: Sequence[object] = ()) -> None:
        assert lora_id is None, "the fake engine serves no adapter"
        assert not images, "the fake engine takes no images"
        if len(prompt_token_ids) >= MAX_MODEL_LEN:
            raise ContextLengthError(f"prompt has {len(prompt_token_ids)} tokens; the model "
                                     f"takes {MAX_MODEL_LEN}", param="prompt")
        if max(prompt_token_ids) >= self.tokenizer.vocab_size:
            raise InvalidRequestError("token id out of range", param="prompt")
        seqs = []
        for index in range(params.n):
            ids = self.reply_ids(index, params)
            seqs.append(FakeSeq([ids[i:i + self.chunk] for i in range(0, len(ids), self.chunk)]))
        self.requests[request_id] = FakeRequest(list(prompt_token_ids), params, seqs)
        self.added.append((request_id, list(prompt_token_ids), priority, cache_salt))

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.requests:
            self.requests[request_id].aborted = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) and not self.lose_requests

    def step(self) -> list[SequenceOutput]:
        outputs = []
        for request_id, request in list(self.requests.items()):
            for index, seq in enumerate(request.seqs):
                if not seq.done:
                    outputs.append(self._advance(request_id, request, index, seq))
            request.sent_prompt_logprobs = True
            if all(seq.done for seq in request.seqs):
                del self.requests[request_id]
        return outputs

    def _advance(self, request_id: str, request: FakeRequest, index: int,
                 seq: FakeSeq) -> SequenceOutput:
        out = SequenceOutput(request_id, request_id, index, [],
                            num_prompt_tokens=len(request.prompt), num_cached_tokens=2)
        if request.params.prompt_logprobs is not None and not request.sent_prompt_logprobs:
            out.prompt_logprobs = [None] + [TokenLogprobs(t, -1.0, 1, [(t, -1.0)])
                                            for t in request.prompt[1:]]
        seq.done = request.aborted
        if request.aborted:
            out.finish_reason = "abort"
            return out
        out.new_token_ids = seq.chunks[seq.pos]
        seq.pos += 1
        if request.params.logprobs is not None:
            out.new_logprobs = [TokenLogprobs(t, -0.5, 1, [(t, -0.5)])
                                for t in out.new_token_ids]
        if seq.pos == len(seq.chunks):
            seq.done = True
            eos = out.new_token_ids[-1] in self.tokenizer.eos_token_ids
            out.finish_reason = "stop" if eos else "length"
        return out


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = build_tokenizer()
    for reply in REPLIES:  # precondition: characters split across tokens (and steps)
        ids = tokenizer.encode(reply, add_special_tokens=False)
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    return tokenizer


def item(tok: Tokenizer, rid: str, text: str = "Say hi", **params: object) -> GenerationItem:
    return GenerationItem(rid, tok.encode(text), SamplingParams(**params))  # type: ignore[arg-type]


# -- OfflineLLM -------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_texts_match_a_full_decode(tok: Tokenizer, chunk: int) -> None:
    engine = FakeEngine(tok, chunk=chunk)
    finished: list[int] = []
    results = OfflineLLM(engine, tok).generate(
        [item(tok, "a", max_tokens=None), item(tok, "b", "Say hi to the fox", n=2, max_tokens=5)],
        finished.append)
    assert sorted(finished) == [0, 1]
    full = engine.reply_ids(0, SamplingParams(max_tokens=None))
    (seq,) = results[0].sequences
    assert (seq.text, seq.token_ids) == (tok.decode(full), full)
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)
    for index, seq in enumerate(results[1].sequences):
        capped = engine.reply_ids(index, SamplingParams(max_tokens=5))
        assert (seq.index, seq.text, seq.finish_reason) == (index, tok.decode(capped), "length")
    assert results[1].num_prompt_tokens == len(tok.encode("Say hi to the fox"))
    assert results[1].num_output_tokens == 10 and results[1].num_cached_tokens == 2
    assert engine.aborted == [] and not engine.requests


def test_stop_string_finishes_one_sequence_of_n(tok: Tokenizer) -> None:
    engine = FakeEngine(tok, chunk=1)
    (result,) = OfflineLLM(engine, tok).generate(
        [item(tok, "r", n=2, stop=("STOP",), max_tokens=None)])
    first, second = result.sequences
    reply = REPLIES[0]
    assert (first.text, first.finish_reason, first.stop_reason) == (
        reply[:reply.index("STOP")], "stop", "STOP")
    full = engine.reply_ids(0, SamplingParams(max_tokens=None))
    # Tokens up to the one that completed the stop string; later deltas are ignored.
    cut = next(k for k in range(len(full) + 1) if "STOP" in tok.decode(full[:k]))
    assert first.token_ids == full[:cut]
    assert (second.text, second.finish_reason) == (REPLIES[1], "stop")
    # The engine never saw the stop string, so the request is aborted once all n are done.
    assert engine.aborted == ["r"]
    assert result.num_output_tokens == cut + len(engine.reply_ids(1, SamplingParams(
        max_tokens=None)))


def test_all_sequences_stopped_ignores_the_abort_outputs(tok: Tokenizer) -> None:
    engine = FakeEngine(tok, chunk=2)
    llm = OfflineLLM(engine, tok)
    (result,) = llm.generate([item(tok, "r", n=2, stop=("fox", "東京"), max_tokens=None)])
    texts = [(s.text, s.finish_reason, s.stop_reason) for s in result.sequences]
    assert texts == [(REPLIES[0][:REPLIES[0].index("fox")], "stop", "fox"),
                     (REPLIES[1][:REPLIES[1].index("東京")], "stop", "東京")]
    assert engine.aborted == ["r"] and not engine.has_unfinished_requests()
    # The engine is clean for the next call.
    (again,) = llm.generate([item(tok, "next")])
    assert again.sequences[0].finish_reason == "length"


def test_bad_items_fail_alone(tok: Tokenizer) -> None:
    engine = FakeEngine(tok)
    progress: list[int] = []
    too_long = GenerationItem("long", [5] * MAX_MODEL_LEN, SamplingParams())
    out_of_vocab = GenerationItem("oov", [tok.vocab_size + 3], SamplingParams())
    items = [item(tok, "ok1"), too_long, out_of_vocab, item(tok, "ok1"), item(tok, "ok2")]
    results = OfflineLLM(engine, tok).generate(items, progress.append)
    assert sorted(progress) == [0, 1, 2, 3, 4]
    assert isinstance(results[1].error, ContextLengthError)
    assert isinstance(results[2].error, InvalidRequestError)
    assert isinstance(results[3].error, InvalidRequestError)  # duplicate request id
    assert "duplicate" in results[3].error.message
    for good in (results[0], results[4]):
        assert good.error is None and good.sequences[0].text == tok.decode(
            engine.reply_ids(0, SamplingParams()))
    assert [r.sequences for r in results[1:4]] == [[], [], []]


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_is_left_out_unless_included(tok: Tokenizer, include: bool) -> None:
    engine = FakeEngine(tok)
    (result,) = OfflineLLM(engine, tok).generate([item(
        tok, "r", max_tokens=None, skip_special_tokens=False, include_stop_str_in_output=include)])
    full = engine.reply_ids(0, SamplingParams(max_tokens=None))
    seq = result.sequences[0]
    assert seq.token_ids == full
    assert seq.text == tok.decode(full if include else full[:-1], skip_special_tokens=False)


def test_logprobs_follow_the_tokens(tok: Tokenizer) -> None:
    engine = FakeEngine(tok, chunk=3)
    (result,) = OfflineLLM(engine, tok).generate([item(tok, "r", logprobs=1, prompt_logprobs=0)])
    seq = result.sequences[0]
    assert seq.logprobs is not None
    assert [lp.token_id for lp in seq.logprobs] == seq.token_ids
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    assert len(result.prompt_logprobs) == result.num_prompt_tokens


def test_an_engine_that_loses_requests_is_an_internal_error(tok: Tokenizer) -> None:
    engine = FakeEngine(tok, lose_requests=True)
    with pytest.raises(InternalError, match="unfinished"):
        OfflineLLM(engine, tok).generate([item(tok, "r")])


# -- run_batch --------------------------------------------------------------------------------

def batch_line(custom_id: str, url: str, body: dict[str, object]) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


CHAT_MESSAGES = [{"role": "user", "content": "Say hi 你好"}]


def write_batch(path: Path) -> list[str]:
    lines = [
        batch_line("plain", "/v1/completions", {"model": "tiny", "prompt": "Say hi",
                                                "max_tokens": 200}),
        batch_line("multi", "/v1/completions", {"prompt": ["Say hi", "the fox"], "n": 2,
                                                "stop": ["STOP"], "max_tokens": 100}),
        b"{not json",
        b"",
        batch_line("chat", "/v1/chat/completions", {"model": "tiny", "messages": CHAT_MESSAGES,
                                                    "max_completion_tokens": 6,
                                                    "logprobs": True, "top_logprobs": 1}),
        batch_line("embed", "/v1/embeddings", {"input": "x"}),
        orjson.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/completions"}),
        batch_line("badparam", "/v1/completions", {"prompt": "x", "max_tokens": "many"}),
        batch_line("toolong", "/v1/completions", {"prompt": "fox " * MAX_MODEL_LEN}),
        batch_line("othermodel", "/v1/chat/completions", {"model": "gpt-4",
                                                          "messages": CHAT_MESSAGES}),
        batch_line("echo", "/v1/completions", {"prompt": "Say hi", "echo": True, "logprobs": 1,
                                               "max_tokens": 3}),
        batch_line("badchat", "/v1/chat/completions", {"messages": [{"role": "user"}]}),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return ["plain", "multi", None, "chat", "embed", "nobody", "badparam", "toolong",  # type: ignore[list-item]
            "othermodel", "echo", "badchat"]


def read_outputs(path: Path) -> dict[str | None, dict[str, object]]:
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert all(r["id"].startswith("batch_req_") for r in records)
    return {r["custom_id"]: r for r in records}


def test_run_batch_output_file(tok: Tokenizer, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = FakeEngine(tok, chunk=2)
    order = write_batch(tmp_path / "in.jsonl")
    summary = run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", OfflineLLM(engine, tok),
                        "tiny")
    records = [orjson.loads(line) for line in (tmp_path / "out.jsonl").read_bytes().splitlines()]
    assert [r["custom_id"] for r in records] == order  # input order, blank line skipped
    assert (summary.total, summary.succeeded, summary.failed) == (11, 4, 7)
    assert "11/11" in capsys.readouterr().err  # the progress bar counted every line
    out = read_outputs(tmp_path / "out.jsonl")
    reply0 = tok.decode(engine.reply_ids(0, SamplingParams(max_tokens=None)))

    plain = out["plain"]["response"]
    assert plain["status_code"] == 200 and out["plain"]["error"] is None
    body = Completion.model_validate(plain["body"])
    assert body.model == "tiny" and body.choices[0].text == reply0
    assert body.usage is not None and body.usage.prompt_tokens == len(tok.encode("Say hi"))

    multi = Completion.model_validate(out["multi"]["response"]["body"])
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert [c.text for c in multi.choices] == [reply0[:reply0.index("STOP")], REPLIES[1]] * 2
    assert multi.usage is not None
    assert multi.usage.prompt_tokens == len(tok.encode("Say hi")) + len(tok.encode("the fox"))

    chat = ChatCompletion.model_validate(out["chat"]["response"]["body"])
    capped = engine.reply_ids(0, SamplingParams(max_tokens=6))
    assert chat.choices[0].message.content == tok.decode(capped)
    assert chat.choices[0].finish_reason == "length"
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert b"".join(bytes(e.bytes or []) for e in logprobs.content) == tok.decode(capped).encode()
    chat_prompt = next(p for rid, p, _, _ in engine.added if rid.startswith("chat#"))
    assert chat_prompt == tok.apply_chat_template(CHAT_MESSAGES)


def test_run_batch_line_errors(tok: Tokenizer, tmp_path: Path) -> None:
    write_batch(tmp_path / "in.jsonl")
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", OfflineLLM(FakeEngine(tok), tok),
              "tiny", show_progress=False)
    out = read_outputs(tmp_path / "out.jsonl")
    line_errors = {cid: (out[cid]["response"], out[cid]["error"]["code"])  # type: ignore[index]
                   for cid in (None, "embed", "nobody")}
    assert line_errors == {None: (None, "invalid_json_line"), "embed": (None, "invalid_url"),
                           "nobody": (None, "missing_body")}
    http = {cid: out[cid]["response"] for cid in ("badparam", "toolong", "othermodel", "badchat")}
    assert {cid: r["status_code"] for cid, r in http.items()} == {  # type: ignore[index]
        "badparam": 400, "toolong": 400, "othermodel": 404, "badchat": 400}
    errors = {cid: r["body"]["error"] for cid, r in http.items()}  # type: ignore[index]
    assert errors["badparam"]["param"] == "max_tokens"
    assert "'max_tokens' must be an integer" in errors["badparam"]["message"]
    assert errors["toolong"]["code"] == "context_length_exceeded"
    assert errors["othermodel"]["param"] == "model"
    assert errors["badchat"]["param"] == "messages[0].content"
    assert all(out[cid]["error"] is None for cid in http)


def test_run_batch_echo_with_logprobs(tok: Tokenizer, tmp_path: Path) -> None:
    engine = FakeEngine(tok)
    write_batch(tmp_path / "in.jsonl")
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", OfflineLLM(engine, tok), "tiny",
              show_progress=False)
    # Raw JSON: the first echoed token has a null logprob, as in OpenAI's API (the
    # client's model types do not allow for that).
    choice = read_outputs(tmp_path / "out.jsonl")["echo"]["response"]["body"]["choices"][0]  # type: ignore[index]
    prompt = tok.encode("Say hi")
    output = engine.reply_ids(0, SamplingParams(max_tokens=3))
    assert choice["text"] == "Say hi" + tok.decode(output)
    logprobs = choice["logprobs"]
    texts = [tok.token_text(t) for t in prompt + output]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == [None] + [-1.0] * (len(prompt) - 1) + [-0.5] * 3
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


def test_unreadable_input_is_a_clear_error(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="cannot read batch input"):
        run_batch(tmp_path / "missing.jsonl", tmp_path / "out.jsonl",
                  OfflineLLM(FakeEngine(tok), tok), "tiny", show_progress=False)
