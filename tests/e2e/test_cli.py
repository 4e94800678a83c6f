"""`meshserve run-batch` end to end: the installed console script on a tiny model folder;
and `start_stack`, what `meshserve up` runs, starting and stopping the mesh.

The reference is OfflineLLM over an in-process LLMEngine of the same folder, given
the same requests (tokenized with the folder's tokenizer) in the same order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import orjson
import pytest
import torch
from lora_adapters import build_adapter, greedy, peft_model
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoModelForCausalLM

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.offline.llm import GenerationItem, GenerationResult, OfflineLLM
from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.errors import UnavailableError
from meshserve.shared.sampling_params import SamplingParams

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
                "--max-model-len", "200", "--num-threads", "1"]
COMPLETION_PROMPTS = ["The quick brown fox", "Hello world, the model serves a"]
CHAT = [{"role": "system", "content": "You serve models."},
        {"role": "user", "content": "Say hello to the gateway."}]
MAX_TOKENS = 10


def meshserve_script() -> Path:
    script = Path(sys.executable).parent / "meshserve"
    assert script.is_file(), f"the meshserve console script is not installed at {script}"
    return script


def batch_lines(model: str) -> list[bytes]:
    def line(custom_id: str, url: str, body: dict[str, object]) -> bytes:
        return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                             "body": body})

    return [
        line("c0", "/v1/completions", {"model": model, "prompt": COMPLETION_PROMPTS[0],
                                       "max_tokens": MAX_TOKENS, "temperature": 0}),
        line("bad", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 5000,
                                        "temperature": 0}),
        line("chat", "/v1/chat/completions", {"model": model, "messages": CHAT,
                                              "max_tokens": MAX_TOKENS, "temperature": 0}),
        line("c1", "/v1/completions", {"model": model, "prompt": COMPLETION_PROMPTS[1],
                                       "max_tokens": MAX_TOKENS, "temperature": 0}),
    ]


def test_run_batch_lines_naming_a_lora_adapter_run_with_it(tiny_llama_dir: Path,
                                                           tmp_path: Path) -> None:
    """As vLLM's run-batch: a line whose `model` is a `--lora-modules` name runs with that
    adapter (transformers + peft's greedy tokens) and answers with its name; the base
    model's lines are untouched; an unknown name fails its line alone (404)."""
    adapter = build_adapter(tiny_llama_dir, tmp_path / "ad", seed=70, rank=8)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    prompt = tokenizer.encode(COMPLETION_PROMPTS[1])
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps({
        "custom_id": custom_id, "method": "POST", "url": "/v1/completions",
        "body": {**body, "model": model}}) + b"\n"
        for custom_id, model in (("base", "tiny"), ("lora", "ad"), ("nope", "other"))))
    target = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    done = subprocess.run(
        [str(meshserve_script()), "run-batch", "-i", str(source), "-o", str(target),
         "--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--no-progress",
         "--enable-lora", "--lora-modules", f"ad={adapter}", *ENGINE_FLAGS],
        check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    records = {r["custom_id"]: r for r in map(orjson.loads, target.read_bytes().splitlines())}
    assert records["nope"]["response"]["status_code"] == 404
    assert records["nope"]["response"]["body"]["error"]["param"] == "model"
    texts = {}
    for custom_id, model in (("base", "tiny"), ("lora", "ad")):
        answer = records[custom_id]["response"]
        assert answer["status_code"] == 200 and answer["body"]["model"] == model
        texts[custom_id] = Completion.model_validate(answer["body"]).choices[0].text
    base_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert texts["base"] == tokenizer.decode(greedy(base_model.eval(), prompt, MAX_TOKENS))
    assert texts["lora"] == tokenizer.decode(
        greedy(peft_model(tiny_llama_dir, adapter), prompt, MAX_TOKENS))
    assert texts["lora"] != texts["base"]


def reference(folder: Path) -> list[GenerationResult]:
    """The good lines' requests through OfflineLLM directly, in file order."""
    engine = build_engine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                    num_kv_blocks=128, max_model_len=200))
    tokenizer = load_tokenizer(str(folder))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat_ids = tokenizer.encode(tokenizer.render_chat(CHAT), add_special_tokens=False)
    items = [GenerationItem("c0", tokenizer.encode(COMPLETION_PROMPTS[0]), params),
             GenerationItem("chat", chat_ids, params),
             GenerationItem("c1", tokenizer.encode(COMPLETION_PROMPTS[1]), params)]
    return OfflineLLM(engine, tokenizer).generate(items)


def test_run_batch_end_to_end(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = str(tiny_llama_dir)
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join(batch_lines(model)) + b"\n")
    target = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    done = subprocess.run(
        [str(meshserve_script()), "run-batch", "-i", str(source), "-o", str(target),
         "--model", model, "--no-progress", *ENGINE_FLAGS],
        check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "3/4 requests succeeded" in done.stderr

    records = [orjson.loads(raw) for raw in target.read_bytes().splitlines()]
    assert [r["custom_id"] for r in records] == ["c0", "bad", "chat", "c1"]
    bad = records[1]["response"]
    assert bad["status_code"] == 400
    assert bad["body"]["error"]["param"] == "max_tokens"
    assert "context length" in bad["body"]["error"]["message"]

    expected = reference(tiny_llama_dir)
    good = [records[0], records[2], records[3]]
    for record, want in zip(good, expected, strict=True):
        assert record["error"] is None and record["response"]["status_code"] == 200
        body = record["response"]["body"]
        seq = want.sequences[0]
        if record["custom_id"] == "chat":
            chat = ChatCompletion.model_validate(body)
            assert chat.choices[0].message.content == seq.text
            assert chat.choices[0].finish_reason == seq.finish_reason
        else:
            completion = Completion.model_validate(body)
            assert completion.choices[0].text == seq.text
            assert completion.choices[0].finish_reason == seq.finish_reason
        assert body["model"] == model
        assert body["usage"]["prompt_tokens"] == want.num_prompt_tokens
        assert body["usage"]["completion_tokens"] == len(seq.token_ids)


@pytest.mark.parametrize("argv, code, message", [
    (["run-batch", "--model", "x"], 2, "input_file"),
    (["run-batch", "-i", "/nonexistent/in.jsonl", "-o", "/tmp/o.jsonl", "--block-size", "7"], 2,
     "block_size"),
    (["frobnicate"], 2, "unknown command"),
    (["serve", "m1", "--model", "m2"], 2, "meshserve serve: the model is given twice"),
    (["up", "--tokenizer", "2"], 2,
     "meshserve up: --tokenizer 2: this vLLM option is not supported by meshserve"),
    (["up", "--tokenizerz", "2"], 2, "meshserve up: unrecognized arguments: --tokenizerz 2"),
])
def test_cli_rejects_bad_invocations(argv: list[str], code: int, message: str) -> None:
    done = subprocess.run([str(meshserve_script()), *argv], check=False, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == code
    assert message in done.stderr
    assert done.stderr.count("meshserve up:") <= 1  # the program is named once


def test_version_names_the_package() -> None:
    done = subprocess.run([str(meshserve_script()), "version"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stdout.splitlines()[0].startswith("meshserve 0.")


def test_start_stack_serves_and_stops(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`start_stack` (what `meshserve up` runs) brings up every service, healthy, and
    stop() ends all of them."""
    config = LauncherConfig(model=str(tiny_llama_dir), port=0, device="cpu", dtype="float32",
                            num_kv_blocks=64, max_model_len=200, run_dir=str(tmp_path / "run"),
                            startup_timeout_s=120, stop_grace_s=10)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    with start_stack(config, environ=env) as stack:
        processes = [s.process for s in stack.services]
        assert {s.name for s in stack.services} == {"tokenizer-0", "scheduler", "kvstore",
                                                    "worker-0", "gateway"}
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        completion = client.completions.create(model=str(tiny_llama_dir), prompt="The quick",
                                               max_tokens=5, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert all(p is not None and p.poll() is not None for p in processes)
    assert all(s.log_path.is_file() for s in stack.services)


def test_start_stack_names_the_service_that_fails(tmp_path: Path) -> None:
    config = LauncherConfig(model=str(tmp_path / "no-such-model"), port=0, device="cpu",
                            kvstore=False, run_dir=str(tmp_path / "run"),
                            startup_timeout_s=120, stop_grace_s=5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    with pytest.raises(UnavailableError) as info:
        start_stack(config, environ=env)
    message = info.value.message
    assert message.startswith(("tokenizer-0 exited", "worker-0 exited")), message
    assert "no-such-model" in message  # the tail of the failing service's log
