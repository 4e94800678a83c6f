"""The whole mesh from `meshserve up` (start_stack), driven by the real `openai` client.

Real processes (tokenizer, scheduler, kvstore, two workers, gateway), a real
embedded Redis, real gRPC and HTTP on loopback, a real OTLP receiver.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import redis
from otlp_receiver import OTLPReceiver
from tiny_models import build_tiny_model
from transformers import AutoTokenizer

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

API_KEY = "test-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A long context, so that a long generation outlasts the disconnect test's one second.
    return build_tiny_model(tmp_path_factory.mktemp("e2e-model"), "llama", seed=5,
                            max_position_embeddings=4096)


@pytest.fixture(scope="module")
def receiver():
    rx = OTLPReceiver().start()
    yield rx
    rx.stop()


@pytest.fixture(scope="module")
def stack(model_dir: Path, receiver: OTLPReceiver, tmp_path_factory: pytest.TempPathFactory):
    config = LauncherConfig(model=str(model_dir), served_model_name=MODEL, workers=2, port=0,
                            api_key=API_KEY, num_kv_blocks=256, dtype="float32",
                            device="cpu", otlp_endpoint=receiver.endpoint,
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def batch_reference(model_dir: Path, tmp_path: Path, bodies: list[tuple[str, dict]]) -> list:
    """The same requests through `meshserve run-batch` (in-process engine)."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with src.open("w") as f:
        for i, (url, body) in enumerate(bodies):
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                                "body": {"model": str(model_dir), **body}}) + "\n")
    subprocess.run([sys.executable, "-m", "meshserve.cli.main", "run-batch", "-i", str(src),
                    "-o", str(dst), "--model", str(model_dir), "--dtype", "float32",
                    "--device", "cpu", "--num-kv-blocks", "256"],
                   check=True, capture_output=True, timeout=300)
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{i}" for i in range(len(bodies))]
    return [line["response"]["body"] for line in lines]


def test_the_stack_names_the_model_clients_use(stack, client) -> None:
    assert stack.model_names() == [MODEL]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such/model")
    assert missing.value.body["param"] == "model"  # type: ignore[index]


def test_embeddings_on_a_generation_model_are_a_400(client) -> None:
    """As in vLLM: a model run for generation does not serve /v1/embeddings."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="hello")
    assert "generation model" in str(refused.value)
    assert refused.value.body["param"] == "model"  # type: ignore[index]


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer) -> None:
    text = "one two three four five six seven eight nine ten"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 4
    for prompt in (text, ids):  # tokenized by the mesh, or token ids sent as they are
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                        temperature=0, extra_body={"truncate_prompt_tokens": 4})
        assert cut.usage is not None and cut.usage.prompt_tokens == 4
        # The echoed prompt is what was kept: the last four tokens.
        assert cut.choices[0].text.startswith(tokenizer.decode(ids[-4:]))
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=text, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 0})
    assert refused.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_echo_with_logprobs_keeps_the_token_of_a_one_token_prompt(client, tokenizer) -> None:
    (first,) = tokenizer("fox", add_special_tokens=False)["input_ids"][:1]
    out = client.completions.create(model=MODEL, prompt=[first], max_tokens=2, echo=True,
                                    logprobs=1, temperature=0)
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == 1 + 2
    assert logprobs.tokens[0] == tokenizer.convert_ids_to_tokens(first)
    assert logprobs.token_logprobs[0] is None  # nothing before it to predict it from
    assert all(lp is not None for lp in logprobs.token_logprobs[1:])


def test_prompt_logprobs_come_back_in_vllms_shape(client, tokenizer) -> None:
    ids = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    # The reference: echo with logprobs (checked against transformers elsewhere).
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                       logprobs=1, temperature=0).choices[0].logprobs
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, n=2,
                                    temperature=0, extra_body={"prompt_logprobs": 2})
    for choice in out.choices:
        got = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
        assert len(got) == len(ids) and got[0] is None
        for position, token in enumerate(ids[1:], start=1):
            entry = got[position]
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(echoed.token_logprobs[position], abs=1e-4)
            assert mine["decoded_token"] == echoed.tokens[position]
            assert mine["rank"] >= 1 and 1 <= len(entry) <= 3  # itself and its top 2
            ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token))
            assert ranks == list(range(1, len(ranks) + 1))
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert refused.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, tokenizer) -> None:
    ids = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, echo=True,
                                    logprobs=1, temperature=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    tokens = out.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens[:len(ids)] == [f"token_id:{i}" for i in ids]
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens[len(ids):])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, logprobs=True, top_logprobs=1,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(c.token.startswith("token_id:") for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_a_request_may_bring_its_own_chat_template(client, tokenizer) -> None:
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template": template})
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(tokenizer("[hi]", add_special_tokens=False)
                                           ["input_ids"])


def test_a_field_meshserve_does_not_implement_is_refused_by_name(client) -> None:
    for field, value in (("vllm_xargs", {"a": 1}), ("logits_processors", ["x"]),
                         ("kv_transfer_params", {"do_remote_prefill": True})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="Say", max_tokens=2,
                                      extra_body={field: value})
        assert refused.value.body["param"] == field  # type: ignore[index]
        assert "not supported" in refused.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, max_tokens=2, store=True,
                                       messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == "store"  # type: ignore[index]
    # The value that asks for nothing (vLLM's default) is accepted.
    ok = client.chat.completions.create(model=MODEL, max_tokens=2, store=False,
                                        messages=[{"role": "user", "content": "hi"}])
    assert ok.usage is not None and ok.usage.completion_tokens == 2


PROMPT = "The quick brown fox jumps over the lazy dog"
CJK_PROMPT = "你好世界 🙂 こんにちは 🌍"


def test_greedy_output_equals_run_batch(client, model_dir: Path, tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "Tell me about 世界 and 🙂"}]
    bodies = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 24, "temperature": 0}),
        ("/v1/completions", {"prompt": CJK_PROMPT, "max_tokens": 40, "temperature": 0}),
    ]
    ref = batch_reference(model_dir, tmp_path, bodies)
    got_completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                               temperature=0)
    assert got_completion.choices[0].text == ref[0]["choices"][0]["text"]
    got_chat = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24,
                                              temperature=0)
    assert got_chat.choices[0].message.content == ref[1]["choices"][0]["message"]["content"]
    assert got_chat.usage.prompt_tokens == ref[1]["usage"]["prompt_tokens"]
    got_cjk = client.completions.create(model=MODEL, prompt=CJK_PROMPT, max_tokens=40,
                                        temperature=0)
    assert got_cjk.choices[0].text == ref[2]["choices"][0]["text"]


def test_streaming_matches_non_streaming_and_keeps_multibyte_text_intact(
        client, tokenizer) -> None:
    whole = client.completions.create(model=MODEL, prompt=CJK_PROMPT, max_tokens=48,
                                      temperature=0, logprobs=0)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in whole.choices[0].logprobs.tokens]
    stream = client.completions.create(model=MODEL, prompt=CJK_PROMPT, max_tokens=48,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    assert text == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 48
    assert finish == "length"
    full = whole.choices[0].text
    if "\ufffd" not in full:  # no piece may show half a character
        assert all("\ufffd" not in p for p in pieces)
    assert len(ids) == 48


def test_chat_streaming_n2_logprobs_and_usage(client) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=12, temperature=1.0, seed=7,
        logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {0: "", 1: ""}
    roles, finishes, usage, lp_count = set(), {}, None, {0: 0, 1: 0}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.delta.role)
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                for entry in choice.logprobs.content:
                    assert len(entry.top_logprobs) == 3
                    assert entry.logprob <= 0.0
                lp_count[choice.index] += len(choice.logprobs.content)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {"assistant"}
    assert set(finishes) == {0, 1}
    assert usage is not None and usage.completion_tokens == lp_count[0] + lp_count[1]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=12,
                                           temperature=1.0, seed=7)
    assert len(whole.choices) == 2 and whole.usage.prompt_tokens == usage.prompt_tokens


def test_stop_string_spanning_tokens_is_cut(client) -> None:
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                     logprobs=0)
    tokens = free.choices[0].logprobs.tokens
    text = free.choices[0].text
    # A stop string made of the end of token 3 and the start of token 4 (as text pieces).
    offsets = free.choices[0].logprobs.text_offset
    base = offsets[0]
    boundary = offsets[4] - base
    stop = text[boundary - 1 : boundary + 1]
    assert len(stop) == 2 and len(tokens) > 5
    cut = text.index(stop)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                    stop=[stop])
    assert got.choices[0].text == text[:cut]
    assert got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop], stream=True)
        if c.choices)
    assert streamed == text[:cut]


def http(stack, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    req = urllib.request.Request(stack.gateway_url + path, data=body, method=method,
                                 headers={"Authorization": f"Bearer {API_KEY}",
                                          "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', {}, 400),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, {},
     400),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "x"}, {}, 404),
    ("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, {}, 400),
    ("prompt past context", "/v1/completions", {"model": MODEL, "prompt": "word " * 9000}, {},
     400),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "x",
                                                "max_tokens": -4}, {}, 400),
    ("oversized body", "/v1/completions", {"model": MODEL, "prompt": "x" * (20 << 20)}, {}, 413),
    ("wrong api key", "/v1/completions", {"model": MODEL, "prompt": "x"},
     {"Authorization": "Bearer wrong"}, 401),
]


@pytest.mark.parametrize(("what", "path", "body", "headers", "status"), BAD,
                         ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_errors_and_the_stack_keeps_serving(
        stack, client, what, path, body, headers, status) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, payload, _ = http(stack, "POST", path, raw, headers)
    assert code == status, (what, payload)
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    ok = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3,
                                   temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def worker_load(address: str):
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                           timeout=5).load


def test_client_disconnect_frees_worker_blocks_within_a_second(stack) -> None:
    baselines = {a: worker_load(a).num_free_blocks for a in stack.worker_addresses}
    # 3000 tokens take the tiny model well over a second: freeing within one means abort.
    body = json.dumps({"model": MODEL, "prompt": PROMPT * 4, "max_tokens": 3000,
                       "ignore_eos": True, "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(stack.base_url + "/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {API_KEY}",
                                          "Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data: ")  # generation is under way
    busy = {a: worker_load(a).num_free_blocks for a in stack.worker_addresses}
    assert any(busy[a] < baselines[a] for a in busy)
    resp.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        now = {a: worker_load(a).num_free_blocks for a in stack.worker_addresses}
        if now == baselines:
            break
        time.sleep(0.02)
    assert now == baselines


def test_both_workers_receive_requests(stack, client) -> None:
    for i in range(8):
        prompt = f"request number {i}: " + " ".join(f"w{i}{j}" for j in range(30))
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    r = redis.Redis.from_url(stack.redis_url)
    holders = {key.decode().rsplit(":", 1)[-1] for key in r.scan_iter("ms:*:holder:*")
               if r.scard(key) > 0}
    assert set(stack.worker_ids) <= holders


def test_one_request_is_one_connected_trace_across_services(stack, receiver) -> None:
    trace_id, caller = os.urandom(16).hex(), os.urandom(8).hex()
    traceparent = f"00-{trace_id}-{caller}-01"
    code, _, _ = http(stack, "POST", "/v1/completions",
                      json.dumps({"model": MODEL, "prompt": "trace me", "max_tokens": 4}).encode(),
                      {"traceparent": traceparent})
    assert code == 200
    wanted = {"gateway", "tokenizer", "scheduler", "worker"}

    def services_seen(spans) -> set[str]:
        return {s.service for s in spans if s.trace_id == trace_id}

    def root_parents(spans) -> set[str]:
        """Parents of the trace's spans that are not spans of it: the caller's alone once
        every service has exported everything (each exports on its own schedule)."""
        mine = [s for s in spans if s.trace_id == trace_id]
        ids = {s.span_id for s in mine}
        return {s.parent_span_id for s in mine if s.parent_span_id not in ids}

    spans = receiver.wait_for(
        lambda s: wanted <= services_seen(s) and root_parents(s) == {caller}, timeout_s=30)
    mine = [s for s in spans if s.trace_id == trace_id]
    assert wanted <= services_seen(spans), sorted({(s.service, s.name) for s in mine})
    assert root_parents(spans) == {caller}, "all spans hang off the caller's span"


def test_killing_a_worker_reroutes_within_its_heartbeat_ttl(stack, client) -> None:
    """The scheduler drops the dead life of worker-1 (the launcher starts a new one, which
    registers with a new epoch) and requests keep succeeding."""
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        def live() -> set[tuple[str, int]]:
            return {(w.info.worker_id, w.info.epoch) for w in stub.ListWorkers(
                scheduler_pb2.ListWorkersRequest(), timeout=5).workers}
        dead = next(entry for entry in live() if entry[0] == "worker-1")
        stack.kill("worker-1", signal.SIGKILL)
        deadline = time.monotonic() + 30
        while dead in live() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dead not in live()
        assert "worker-0" in {worker_id for worker_id, _ in live()}
    for i in range(6):
        out = client.completions.create(model=MODEL, prompt=f"after the crash {i}",
                                        max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason == "length"
