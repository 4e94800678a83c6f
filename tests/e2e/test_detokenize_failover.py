"""Streams outlive their tokenizer replica: `kill -9` of a tokenizer mid-stream, and no
client notices.

One `meshserve up` stack (start_stack) with one worker and two tokenizer replicas on a tiny
model, driven by the real `openai` client. The same streams (half of them with logprobs,
some with a stop string late in their text) run once undisturbed, then again while
tokenizer replicas get SIGKILL once every stream has sent chunks: one replica (its streams
move to the other), then both (the streams wait for the launcher to restart them). Each
stream must complete with exactly the token ids, text, logprob tokens and finish reason
of its undisturbed run, and no error event. (Not the logprobs' text offsets: within a chunk
they add up the tokens' own texts, which differ from their text in context, so they follow
how the worker happened to group tokens into messages, in any run.)

Two things would make even two undisturbed runs differ, so the streams avoid them. They
sample with a seed (draws keyed by seed and output position) rather than greedily: the
random model's logits have near-ties that the batch's make-up can flip. And a logit_bias
bans tokens that are not whole characters: the text of stray UTF-8 bytes depends on how the
worker happened to group tokens into entries (the detokenizer gives up holding a broken
character after a while). Cuts inside characters are tested where the grouping is fixed:
tests/tokenizer/test_request_resume.py and tests/contract/test_detokenize_session.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

MODEL = "tiny"
STREAMS = 8
MAX_TOKENS = 400
STARTED_CHUNKS = 3  # chunks a stream has before the kill
BACK_TIMEOUT_S = 120.0
TOKENIZERS = ("tokenizer-0", "tokenizer-1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("detok-model"), "llama", seed=13,
                            max_position_embeddings=4096)


@pytest.fixture(scope="module")
def whole_characters(model_dir: Path) -> dict[str, float]:
    """A logit_bias banning every token whose own text is not whole characters."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    banned = {str(t): -100.0 for t in range(vocab) if t >= len(tokenizer)
              or "\ufffd" in (tokenizer.decode([t], skip_special_tokens=True) or "\ufffd")}
    assert len(banned) < vocab - 100, "too few tokens left"
    return banned


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=1,
                            tokenizers=2, port=0, num_kv_blocks=1024, dtype="float32",
                            device="cpu", kvstore=False,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=5)
    with start_stack(config) as running:
        yield running


@dataclass
class Stream:
    """What one client stream received."""

    body: dict[str, Any]
    parts: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # of its logprobs
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic()
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def body(i: int, bias: dict[str, float]) -> dict[str, Any]:
    """Stream i: its own prompt and seed; odd ones ask for logprobs (their token texts)."""
    request: dict[str, Any] = {"model": MODEL, "prompt": f"{i}: tell me a story",
                               "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 1000 + i,
                               "logit_bias": bias,
                               "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    if i % 2:
        request["logprobs"] = 1
    return request


async def run_stream(client: openai.AsyncOpenAI, stream: Stream) -> None:
    """Read one stream to its end (an error event raises APIError in the client);
    `started` is set after STARTED_CHUNKS chunks, or at the end."""
    try:
        response = await client.completions.create(stream=True, **stream.body)
        async for chunk in response:
            stream.chunk_times.append(time.monotonic())
            for choice in chunk.choices:
                stream.parts.append(choice.text)
                stream.token_ids.extend(getattr(choice, "token_ids", None) or [])
                if choice.logprobs is not None:
                    stream.tokens.extend(choice.logprobs.tokens or [])
                stream.finish_reason = choice.finish_reason or stream.finish_reason
            if len(stream.chunk_times) >= STARTED_CHUNKS:
                stream.started.set()
    except openai.APIError as exc:
        stream.error = exc
    finally:
        stream.started.set()


async def run_streams(stack: Stack, bodies: list[dict[str, Any]],
                      kill: Callable[[], None] | None = None) -> tuple[list[Stream], float]:
    """Every stream, with `kill` called once all have started; and the time of the kill."""
    streams = [Stream(b) for b in bodies]
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0,
                                  timeout=180.0) as client:
        tasks = [asyncio.ensure_future(run_stream(client, s)) for s in streams]
        await asyncio.gather(*(s.started.wait() for s in streams))
        killed_at = time.monotonic()
        if kill is not None:
            kill()
        await asyncio.gather(*tasks)
    return streams, killed_at


def late_stop(text: str) -> tuple[str, int]:
    """A 3-character stop string first found in the last quarter of `text`, and where."""
    for start in range(len(text) * 3 // 4, len(text) - 3):
        stop = text[start:start + 3]
        if text.find(stop) == start and "\ufffd" not in stop:
            return stop, start
    raise AssertionError(f"no stop string found in {text!r}")


@pytest.fixture(scope="module")
def bodies(stack: Stack, whole_characters: dict[str, float]) -> list[dict[str, Any]]:
    """The streams' requests: every third stops on a string late in its plain run's text
    (checked: that run, undisturbed and with the stop, ends just before it)."""
    requests = [body(i, whole_characters) for i in range(STREAMS)]
    plain, _ = asyncio.run(run_streams(stack, requests))
    texts: dict[int, str] = {}
    for i, stream in enumerate(plain):
        assert stream.error is None, stream.error
        assert (stream.finish_reason, len(stream.token_ids)) == ("length", MAX_TOKENS)
        if i % 3 == 0:
            stop, start = late_stop(stream.text)
            requests[i]["stop"] = [stop]
            texts[i] = stream.text[:start]
    stopped, _ = asyncio.run(run_streams(stack, [requests[i] for i in texts]))
    for i, stream in zip(texts, stopped, strict=True):
        assert (stream.error, stream.finish_reason, stream.text) == (None, "stop", texts[i])
    return requests


@pytest.fixture(scope="module")
def undisturbed(stack: Stack, bodies: list[dict[str, Any]]) -> list[Stream]:
    streams, _ = asyncio.run(run_streams(stack, bodies))
    assert all(s.error is None for s in streams), [s.error for s in streams]
    return streams


def moved(stack: Stack) -> float:
    """meshserve:gateway_detokenize_failovers_total{outcome="moved"} of the gateway."""
    (url,) = stack.gateway_metrics_urls
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(r'meshserve:gateway_detokenize_failovers_total\{outcome="moved"\} '
                      r'([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def wait_back(stack: Stack, name: str) -> None:
    """Until the launcher's restart of `name` is SERVING (a restart sends no signal)."""
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while not stack.service_healthy(name):
        assert time.monotonic() < deadline, f"{name} was not back within {BACK_TIMEOUT_S}s"
        time.sleep(0.1)


def assert_undisturbed(streams: list[Stream], reference: list[Stream], killed_at: float) -> None:
    for i, (got, want) in enumerate(zip(streams, reference, strict=True)):
        assert got.error is None, (i, got.error)
        assert got.chunk_times[-1] > killed_at, f"stream {i} had ended before the kill"
        assert got.finish_reason == want.finish_reason, i
        assert got.token_ids == want.token_ids, f"stream {i}: other token ids"
        assert got.tokens == want.tokens, i
        assert got.text == want.text, i
    assert any(len(s.text.encode()) > len(s.text) for s in reference), "no multi-byte text"


def test_streams_on_a_killed_replica_move_to_the_other(
        stack: Stack, bodies: list[dict[str, Any]], undisturbed: list[Stream]) -> None:
    before = moved(stack)
    streams, killed_at = asyncio.run(run_streams(
        stack, bodies, lambda: stack.kill("tokenizer-0", signal.SIGKILL)))
    assert_undisturbed(streams, undisturbed, killed_at)
    # Round robin put some of the streams on the killed replica; only those moved.
    assert 0 < moved(stack) - before < STREAMS
    wait_back(stack, "tokenizer-0")
    assert stack.restarts("tokenizer-0") == 1


def test_streams_wait_for_a_restarted_replica(
        stack: Stack, bodies: list[dict[str, Any]], undisturbed: list[Stream]) -> None:
    for name in TOKENIZERS:
        wait_back(stack, name)
    before = moved(stack)

    def kill_both() -> None:
        for name in TOKENIZERS:
            stack.kill(name, signal.SIGKILL)

    streams, killed_at = asyncio.run(run_streams(stack, bodies, kill_both))
    assert_undisturbed(streams, undisturbed, killed_at)
    assert moved(stack) - before >= STREAMS  # every stream lost its replica
    for name in TOKENIZERS:
        wait_back(stack, name)
    assert stack.restarts("tokenizer-1") == 1
    assert stack.running()
