"""Disaggregated serving keeps the other features working, end to end (issue 32; CPU, tiny model).

One `meshserve up`-like stack of one prefill and one decode worker with `--kv-handoff ipc`
and no kvstore: the prefill worker holds each handed-off prompt's KV blocks in its slot pool
(POSIX shared memory on a CPU), which the decode worker maps and copies from. Through the
real `openai` client, with a mixed worker's answers (a reference stack, run first and
stopped) where answers must match:

- prefix caching on both sides: a repeated prompt hits the prefill worker's cache
  (usage.prompt_tokens_details.cached_tokens), and the decode worker maps none of its
  blocks again (it has them); a handoff maps exactly the blocks it receives;
- structured outputs (a JSON schema) and a LoRA adapter through the handoff: the mixed
  worker's greedy answers; an adapter's cached blocks are never taken for the base model's;
- a stream closed by its client right after the first token (around the handoff) or after
  a few decode tokens, and a request past the gateway's deadline (504, its decode worker
  stopped meanwhile): the decode worker ends up with nothing running or waiting, the
  handed-off blocks are freed on both workers (at once, or after --kv-handoff-hold-s), and
  the next request is served;
- one trace holds the prefill worker's and the decode worker's spans (OTLP);
- the workers' vllm:* counters split the tokens between them;
- an FP8 KV cache is handed off as it is, pushed into the decode worker's pool layer by
  layer (--kv-handoff-push): the greedy tokens of the in-process engine with the same
  cache (a stack of its own, the cache's dtype being the whole stack's).

Logprobs agree to float32 rounding (1e-4), as in test_disagg_stack.py, for the same reasons.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from lora_adapters import build_adapter
from otlp_receiver import OTLPReceiver, ReceivedSpan
from test_disagg_stack import assert_same, handoff_blocks, worker_metric
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, Stack, start_stack
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams

MODEL = "tiny-disagg-features"
ADAPTER = "sticker"
BLOCK = 16
# The prefill worker's pool in /dev/shm: the tiny model's prompts need a few KiB, and a
# container's /dev/shm may be small (64 MiB by default under docker).
POOL_BYTES = 16 << 20
MIN_PROMPT_TOKENS = 32
MAX_TOKENS = 6
LONG_MAX_TOKENS = 900  # far longer than any abort below waits
REQUEST_TIMEOUT_S = 5.0  # the gateway's deadline of every request
HOLD_S = 4.0  # how long the prefill worker holds blocks nobody mapped
SETTLE_TIMEOUT_S = 30.0

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "size": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "size"], "additionalProperties": False}


def prompt(seed: int) -> list[int]:
    """A long prompt (3 full blocks and a partial one), distinct from its first block."""
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(3 * BLOCK + 7)]


PREFIX_PROMPT = prompt(351)
LORA_PROMPT = prompt(352)
TRACE_PROMPT = prompt(353)
CHAT_TEXT = " ".join(f"item{i} weighs {i * 7} grams" for i in range(12))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("disagg-features-model"), "llama",
                            seed=35, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapter(model_dir, tmp_path_factory.mktemp("adapter") / ADAPTER, seed=36)


def launch(model_dir: Path, adapter_dir: Path, run_dir: Path,
           environ: dict[str, str] | None = None, **overrides: Any) -> Iterator[Stack]:
    config = LauncherConfig(**{
        "model": str(model_dir), "served_model_name": MODEL, "port": 0, "kvstore": False,
        "num_kv_blocks": 256, "block_size": BLOCK, "dtype": "float32", "device": "cpu",
        "enable_lora": True, "lora_modules": f"{ADAPTER}={adapter_dir}",
        "run_dir": str(run_dir), "startup_timeout_s": 300, "stop_grace_s": 5, **overrides})
    environ = {**os.environ, "MESHSERVE_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
               "MESHSERVE_KV_HANDOFF_HOLD_S": str(HOLD_S), **(environ or {})}
    with start_stack(config, environ=environ) as running:
        yield running


def client_for(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)


def complete(stack: Stack, tokens: list[int], model: str = MODEL, **extra: Any
             ) -> dict[str, Any]:
    """A greedy completion: text, token logprobs, top logprobs and the cached prompt tokens."""
    with client_for(stack) as client:
        response = client.completions.create(
            model=model, prompt=tokens, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
            extra_body={"ignore_eos": True}, **extra)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.logprobs is not None
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return {"text": choice.text, "tokens": choice.logprobs.tokens,
            "token_logprobs": choice.logprobs.token_logprobs,
            "top_logprobs": choice.logprobs.top_logprobs,
            "cached": response.usage.prompt_tokens_details.cached_tokens}


def json_chat(stack: Stack) -> str:
    """A greedy chat answer under SCHEMA (a prompt long enough to be handed off)."""
    with client_for(stack) as client:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": CHAT_TEXT}], temperature=0,
            max_tokens=200, response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": SCHEMA, "strict": True}})
    assert response.choices[0].finish_reason == "stop"
    assert response.usage is not None and response.usage.prompt_tokens >= MIN_PROMPT_TOKENS
    return response.choices[0].message.content or ""


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Any]:
    """What one mixed worker answers (its stack stopped before the disaggregated one starts)."""
    for stack in launch(model_dir, adapter_dir, tmp_path_factory.mktemp("mixed"), workers=1):
        return {"prefix": complete(stack, PREFIX_PROMPT), "json": json_chat(stack),
                "lora": complete(stack, LORA_PROMPT, ADAPTER),
                "base": complete(stack, LORA_PROMPT)}
    raise AssertionError("the reference stack did not start")


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    rx = OTLPReceiver().start()
    yield rx
    rx.stop()


@pytest.fixture(scope="module")
def stack(model_dir: Path, adapter_dir: Path, reference: dict[str, Any],
          receiver: OTLPReceiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from launch(model_dir, adapter_dir, tmp_path_factory.mktemp("disagg-ipc"),
                      workers=0, prefill_workers=1, decode_workers=1, kv_handoff="ipc",
                      kv_handoff_hold_bytes=POOL_BYTES, disagg_min_prompt_tokens=MIN_PROMPT_TOKENS,
                      otlp_endpoint=receiver.endpoint,
                      # Spans exported within 0.2 s of their end, not the default 5 s.
                      environ={"OTEL_BSP_SCHEDULE_DELAY": "200"})


def summed(stack: Stack, worker: str, name: str) -> float:
    """The sum of a metric's samples over all their labels on `worker`'s /metrics."""
    (service,) = [s for s in stack.services if s.name == worker]
    text = urllib.request.urlopen(service.metrics_url, timeout=5).read().decode()
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


MAPPED = "meshserve:kv_handoff_mapped_blocks_total"
HELD = "meshserve:kv_handoff_held_bytes"
PUSHED = "meshserve:kv_handoff_pushed_blocks_total"


def test_a_repeated_prompt_hits_both_caches_and_maps_no_block_twice(
        stack: Stack, reference: dict[str, Any]) -> None:
    full = len(PREFIX_PROMPT) // BLOCK
    hits = {w: summed(stack, w, "vllm:prefix_cache_hits_total") for w in stack.worker_ids}
    mapped, received = worker_metric(stack, "decode-0", MAPPED), \
        handoff_blocks(stack, "decode-0", "received")
    first = complete(stack, PREFIX_PROMPT)
    assert_same(first, reference["prefix"], "first run")
    assert first["cached"] == 0
    # A handoff over ipc maps every block it receives from the prefill worker's pool.
    assert worker_metric(stack, "decode-0", MAPPED) == mapped + full
    assert handoff_blocks(stack, "decode-0", "received") == received + full
    assert summed(stack, "prefill-0", "vllm:prefix_cache_hits_total") == hits["prefill-0"]

    pulled = worker_metric(stack, "decode-0", "meshserve:kv_handoff_pulled_bytes_total")
    second = complete(stack, PREFIX_PROMPT)
    assert_same(second, reference["prefix"], "second run")
    assert second["cached"] == full * BLOCK
    assert summed(stack, "prefill-0", "vllm:prefix_cache_hits_total") \
        == hits["prefill-0"] + full * BLOCK
    # Handed off again, but the decode worker found every block in its own cache.
    assert handoff_blocks(stack, "decode-0", "received") == received + 2 * full
    assert worker_metric(stack, "decode-0", MAPPED) == mapped + full
    assert worker_metric(stack, "decode-0", "meshserve:kv_handoff_pulled_bytes_total") == pulled
    assert summed(stack, "decode-0", "vllm:prefix_cache_hits_total") \
        >= hits["decode-0"] + 2 * full * BLOCK


def test_a_json_schema_answer_is_handed_off_as_on_the_mixed_worker(
        stack: Stack, reference: dict[str, Any]) -> None:
    sent = handoff_blocks(stack, "prefill-0", "sent")
    text = json_chat(stack)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == reference["json"]
    assert handoff_blocks(stack, "prefill-0", "sent") > sent


def test_a_lora_adapter_is_handed_off_and_its_blocks_stay_its_own(
        stack: Stack, reference: dict[str, Any]) -> None:
    assert reference["lora"]["tokens"] != reference["base"]["tokens"]
    full = len(LORA_PROMPT) // BLOCK
    sent, mapped = handoff_blocks(stack, "prefill-0", "sent"), \
        worker_metric(stack, "decode-0", MAPPED)
    adapted = complete(stack, LORA_PROMPT, ADAPTER)
    assert_same(adapted, reference["lora"], "the adapter")
    again = complete(stack, LORA_PROMPT, ADAPTER)
    assert_same(again, reference["lora"], "the adapter again")
    assert again["cached"] == full * BLOCK
    assert worker_metric(stack, "decode-0", MAPPED) == mapped + full
    # The same tokens under the base model hit neither worker's adapter blocks.
    base = complete(stack, LORA_PROMPT)
    assert_same(base, reference["base"], "the base model")
    assert base["cached"] == 0
    assert worker_metric(stack, "decode-0", MAPPED) == mapped + 2 * full
    assert handoff_blocks(stack, "prefill-0", "sent") == sent + 3 * full


RESERVED = "meshserve:kv_handoff_reserved_slots"


def settled(stack: Stack, held: float) -> Callable[[], bool]:
    """Whether the decode worker runs and queues nothing, holds no pushed block and no
    reserved slot, and the prefill worker holds `held` bytes of handed-off blocks again."""
    def check() -> bool:
        queued = sum(summed(stack, "decode-0", f"vllm:num_requests_{state}")
                     for state in ("running", "waiting"))
        return (queued == 0 and worker_metric(stack, "prefill-0", HELD) == held
                and worker_metric(stack, "decode-0", HELD) == 0
                and worker_metric(stack, "decode-0", RESERVED) == 0)
    return check


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {SETTLE_TIMEOUT_S}s: {what}"
        time.sleep(0.05)  # polling the workers' metrics: nothing signals it


def read_then_close(stack: Stack, tokens: list[int], count: int) -> int:
    """Stream a long greedy completion, read `count` tokens, then close the connection;
    how many tokens came."""
    read = 0
    with client_for(stack) as client:
        response = client.completions.create(
            model=MODEL, prompt=tokens, max_tokens=LONG_MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            logprobs=0)
        for chunk in response:
            for choice in chunk.choices:
                read += len(choice.logprobs.tokens or []) if choice.logprobs else 0
            if read >= count:
                break
        response.close()
    return read


EXPIRED = "meshserve:kv_handoff_expired_blocks_total"


def handoff_counts(stack: Stack) -> tuple[float, float, float]:
    """Blocks the prefill worker handed off (held, or pushed into the decode worker's pool),
    the decode worker copied from a pool (the prefill worker's mapped, or its own), and
    either worker freed unloaded after --kv-handoff-hold-s."""
    return (handoff_blocks(stack, "prefill-0", "sent"), worker_metric(stack, "decode-0", MAPPED),
            worker_metric(stack, "prefill-0", EXPIRED) + worker_metric(stack, "decode-0",
                                                                       EXPIRED))


@pytest.mark.parametrize("count", [1, 4], ids=["after-first-token", "after-decode-tokens"])
def test_a_stream_closed_by_its_client_leaves_nothing_behind(
        stack: Stack, reference: dict[str, Any], count: int) -> None:
    held = worker_metric(stack, "prefill-0", HELD)
    # Blocks pushed by earlier tests that the decode worker had cached are freed first.
    wait_until(settled(stack, held), "the earlier requests let go")
    generated = "vllm:generation_tokens_total"
    decoded = summed(stack, "decode-0", generated)
    before = handoff_counts(stack)
    assert read_then_close(stack, prompt(360 + count), count) >= count
    wait_until(settled(stack, held), "the closed stream's request let go")
    sent, mapped, expired = (now - then for now, then in zip(handoff_counts(stack), before,
                                                             strict=True))
    # Every held block was mapped by the decode worker or freed unmapped: closed after the
    # first token, the request may end before it moves to the decode worker.
    assert sent == len(prompt(360 + count)) // BLOCK
    assert mapped + expired == sent
    if count > 1:  # it reached the decode worker, which stopped it long before its end
        assert mapped == sent
        assert 0 < summed(stack, "decode-0", generated) - decoded < LONG_MAX_TOKENS // 2
    assert_same(complete(stack, PREFIX_PROMPT), reference["prefix"], "the next request")


def test_a_request_past_its_deadline_is_a_504_and_leaves_nothing_behind(
        stack: Stack, reference: dict[str, Any]) -> None:
    held = worker_metric(stack, "prefill-0", HELD)
    wait_until(settled(stack, held), "the earlier requests let go")
    before = handoff_counts(stack)
    stack.kill("decode-0", signal.SIGSTOP)  # the handed-off request waits for it
    try:
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            answer = pool.submit(complete, stack, prompt(370))
            wait_until(lambda: worker_metric(stack, "prefill-0", HELD) > held,
                       "the prefill worker holds the prompt's blocks")
            with pytest.raises(openai.APIStatusError) as failed:
                answer.result()
            took = time.monotonic() - started
    finally:
        stack.kill("decode-0", signal.SIGCONT)
    assert failed.value.status_code == 504, failed.value.body
    assert took >= REQUEST_TIMEOUT_S - 0.5
    wait_until(settled(stack, held), "the expired request let go")
    sent, mapped, expired = (now - then for now, then in zip(handoff_counts(stack), before,
                                                             strict=True))
    assert (sent, mapped, expired) == (len(prompt(370)) // BLOCK, 0, sent)
    assert_same(complete(stack, PREFIX_PROMPT), reference["prefix"], "the next request")


def worker_spans(spans: list[ReceivedSpan], trace_id: str) -> dict[str, set[str]]:
    """The worker spans of a trace, by the worker that sent them."""
    found: dict[str, set[str]] = {}
    for span in spans:
        if span.trace_id == trace_id and span.service == "worker":
            found.setdefault(span.attributes.get("meshserve.worker.id", ""), set()).add(
                span.name)
    return found


def test_one_trace_holds_both_workers_spans(stack: Stack, receiver: OTLPReceiver) -> None:
    trace_id, caller = os.urandom(16).hex(), os.urandom(8).hex()
    complete(stack, TRACE_PROMPT, extra_headers={"traceparent": f"00-{trace_id}-{caller}-01"})
    wanted = {"prefill-0": {"worker.prefill"}, "decode-0": {"worker.decode"}}

    def roots(spans: list[ReceivedSpan]) -> set[str]:
        """Parents of the trace's spans that are not spans of it: the caller's alone once
        every service has exported everything (each exports on its own schedule)."""
        mine = [s for s in spans if s.trace_id == trace_id]
        return {s.parent_span_id for s in mine} - {s.span_id for s in mine}

    def services(spans: list[ReceivedSpan]) -> set[str]:
        return {s.service for s in spans if s.trace_id == trace_id}

    def complete_trace(spans: list[ReceivedSpan]) -> bool:
        found = worker_spans(spans, trace_id)
        return roots(spans) == {caller} and {"gateway", "scheduler"} <= services(spans) \
            and all(names <= found.get(worker, set()) for worker, names in wanted.items())

    spans = receiver.wait_for(complete_trace, timeout_s=30)
    assert complete_trace(spans), (worker_spans(spans, trace_id), roots(spans), services(spans))


def test_the_workers_vllm_counters_split_a_handed_off_request(stack: Stack) -> None:
    names = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
             "vllm:request_success_total")
    before = {(w, n): summed(stack, w, n) for w in stack.worker_ids for n in names}
    complete(stack, prompt(380))
    moved = {key: summed(stack, *key) - value for key, value in before.items()}
    # The prefill worker sampled the first token, the decode worker the rest; the prompt
    # is counted once, where it was computed; each worker finished its part.
    assert moved["prefill-0", "vllm:generation_tokens_total"] == 1
    assert moved["decode-0", "vllm:generation_tokens_total"] == MAX_TOKENS - 1
    assert moved["prefill-0", "vllm:prompt_tokens_total"] == len(prompt(380))
    assert moved["decode-0", "vllm:prompt_tokens_total"] == 0
    assert moved["prefill-0", "vllm:request_success_total"] == 1
    assert moved["decode-0", "vllm:request_success_total"] == 1


def engine_tokens(model_dir: Path, tokens: list[int]) -> list[int]:
    """The greedy tokens of the in-process engine with an FP8 KV cache (a mixed worker's)."""
    engine = build_engine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                       num_kv_blocks=64, block_size=BLOCK, kv_cache_dtype="fp8"))
    engine.add_request("fp8", tokens, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for step in engine.step():
            out += step.new_token_ids
    return out


def token_ids(stack: Stack, tokens: list[int]) -> tuple[list[int], int]:
    """A greedy completion's token ids and its cached prompt tokens."""
    with client_for(stack) as client:
        response = client.completions.create(
            model=MODEL, prompt=tokens, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and response.usage is not None
    details = response.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens], details.cached_tokens


def test_an_fp8_kv_cache_is_handed_off_as_on_a_mixed_fp8_worker(
        stack: Stack, model_dir: Path, adapter_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The KV cache's dtype is the whole stack's: this one test starts a stack of its own."""
    tokens = prompt(390)
    full = len(tokens) // BLOCK
    want = engine_tokens(model_dir, tokens)
    for fp8 in launch(model_dir, adapter_dir, tmp_path_factory.mktemp("disagg-fp8"),
                      workers=0, prefill_workers=1, decode_workers=1, kv_handoff="ipc",
                      kv_handoff_hold_bytes=POOL_BYTES, disagg_min_prompt_tokens=MIN_PROMPT_TOKENS,
                      kv_cache_dtype="fp8", kv_handoff_push=True,
                      enable_lora=False, lora_modules=None):
        assert token_ids(fp8, tokens) == (want, 0)
        # The FP8 blocks, as they are: pushed into the decode worker's pool, copied from it.
        assert worker_metric(fp8, "prefill-0", PUSHED) == full
        assert worker_metric(fp8, "decode-0", MAPPED) == full
        assert token_ids(fp8, tokens) == (want, full * BLOCK)
        assert worker_metric(fp8, "decode-0", MAPPED) == full
        assert handoff_blocks(fp8, "prefill-0", "sent") == 2 * full
