"""Images through the whole mesh (`start_stack`, what `meshserve up` runs) with the real
`openai` client, on tiny LLaVA, Qwen2.5-VL and Gemma 3 folders, with the workers encoding
images themselves and with an encoder service (`--encoders 1`).

Greedy answers equal transformers' on the same weights and images (data URLs, and an http
URL from a server on 127.0.0.2, the one non-public network the stack allows); a URL on
127.0.0.1 is refused by the SSRF guard and a file that is no image is a 400 naming its part,
while requests beside them are served; the same image again is a prefix-cache hit, counted
on the worker's /metrics, as are the images the encoder service made.
"""

from __future__ import annotations

import base64
import http.server
import os
import re
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from tiny_vlm import build_tiny_vlm, load_processor
from transformers import AutoModelForImageTextToText
from vlm_reference import hf_vlm_greedy, image_file, vlm_case

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

MAX_TOKENS = 6
WIDE, TALL = image_file(80, 60, 21), image_file(40, 90, 22, "JPEG")


def data_url(data: bytes) -> str:
    kind = "jpeg" if data[:2] == b"\xff\xd8" else "png"
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


@dataclass
class Served:
    """A running stack over the folder, transformers' model, and an image server."""

    stack: Stack
    client: openai.OpenAI
    folder: Path
    hf: torch.nn.Module
    processor: object
    image_url: str  # TALL, served on 127.0.0.2 (allowed)
    loopback_url: str  # the same, on 127.0.0.1 (refused)


@pytest.fixture(scope="module")
def images_http() -> Iterator[dict[str, str]]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(TALL)))
            self.end_headers()
            self.wfile.write(TALL)

        def log_message(self, *args: object) -> None:
            pass

    servers = [http.server.ThreadingHTTPServer((host, 0), Handler)
               for host in ("127.0.0.2", "127.0.0.1")]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {host: f"http://{host}:{server.server_address[1]}/tall.jpg"
           for host, server in zip(("127.0.0.2", "127.0.0.1"), servers, strict=True)}
    for server in servers:
        server.shutdown()


@pytest.fixture(scope="module", params=[("llava", 0), ("llava", 1), ("qwen2_5_vl", 1),
                                        ("gemma3", 0)],
                ids=["llava-worker-encodes", "llava-encoder-service",
                     "qwen2_5_vl-encoder-service", "gemma3-worker-encodes"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           images_http: dict[str, str]) -> Iterator[Served]:
    family, encoders = request.param
    folder = build_tiny_vlm(tmp_path_factory.mktemp(family), family, seed=9)
    config = LauncherConfig(model=str(folder), port=0, device="cpu", dtype="float32",
                            num_kv_blocks=64, encoders=encoders,
                            allowed_media_networks=("127.0.0.2/32",),
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    env["HF_HUB_OFFLINE"] = "1"
    processor = load_processor(folder)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    with start_stack(config, environ=env) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        yield Served(stack, client, folder, hf, processor, images_http["127.0.0.2"],
                     images_http["127.0.0.1"])


def _parts(*items: object) -> list[dict[str, object]]:
    return [{"type": "text", "text": item} if isinstance(item, str)
            else {"type": "image_url", "image_url": {"url": item[1]}}  # type: ignore[index]
            for item in items]


def _expected(served: Served, text_and_files: list[object]) -> str:
    """transformers' greedy answer to one user turn of texts and (url, file) images."""
    parts = [{"type": "text", "text": item} if isinstance(item, str) else {"type": "image"}
             for item in text_and_files]
    files = [item[0] for item in text_and_files if not isinstance(item, str)]  # type: ignore[index]
    config = served.hf.config
    token = getattr(config, "image_token_id", None) or config.image_token_index
    case = vlm_case(served.processor, token,
                    [{"role": "user", "content": parts}], files)
    tokens = hf_vlm_greedy(served.hf, case, MAX_TOKENS)
    return served.processor.tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[attr-defined]


def _ask(served: Served, items: list[object]) -> openai.types.chat.ChatCompletion:
    return served.client.chat.completions.create(
        model=str(served.folder), messages=[{"role": "user", "content": _parts(*items)}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})


def _metric(served: Served, name: str, **labels: str) -> float:
    url = served.stack.metrics_urls["worker-0"]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and wanted in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not on the worker's /metrics")


def test_answers_equal_transformers(served: Served) -> None:
    chats: list[list[object]] = [
        ["What is in this picture?", (WIDE, data_url(WIDE))],
        ["Compare", (TALL, served.image_url), "with", (WIDE, data_url(WIDE)), "please."],
    ]
    for items in chats:
        answer = _ask(served, items)
        assert answer.choices[0].message.content == _expected(served, items)
        assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS


def test_refused_images_are_400s_naming_the_part_and_others_are_served(
        served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as loopback:
        _ask(served, ["Look:", (TALL, served.loopback_url)])
    assert "messages[0].content[1]" in str(loopback.value)
    assert re.search(r"loopback|not allowed|forbidden", str(loopback.value))
    with pytest.raises(openai.BadRequestError) as broken:
        _ask(served, ["Look:", (b"", "data:image/png;base64," +
                                base64.b64encode(b"not a png at all").decode())])
    assert "messages[0].content[1]" in str(broken.value)
    items: list[object] = ["Still there?", (WIDE, data_url(WIDE))]
    assert _ask(served, items).choices[0].message.content == _expected(served, items)


def test_a_repeated_image_is_a_prefix_cache_hit(served: Served) -> None:
    items: list[object] = ["Once more, this one:", (TALL, data_url(TALL)), "what is it?"]
    first = _ask(served, items)
    again = _ask(served, items)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # past the image's tokens
    assert _metric(served, "vllm:mm_cache_hits_total") >= 1
    where = "encoder" if served.stack.config.encoders else "worker"
    assert _metric(served, "meshserve:worker_images_encoded_total", where=where) >= 2
