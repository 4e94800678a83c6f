"""Images in chat requests through a real gateway, its fake tokenizer and worker (real gRPC on
127.0.0.1) and a real image server: the tokenizer gets `{"type": "image"}` parts and each
image's size, the worker gets each image's bytes, SHA-256 and placeholder run; a bad image
is a 400 naming its part while the request beside it is served. Last, the real tokenizer
servicer of a tiny LLaVA-NeXT folder in place of the fake one."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from image_prompts import IMAGE, ImageChat, reference, text
from media_server import JPEG, PNG, ImageServer, image_server, picture
from openai import AsyncOpenAI, BadRequestError, InternalServerError
from test_gateway_fakes import MODEL, FakeTokenizer, Mesh, script, start_mesh
from tiny_vlm import build_tiny_vlm, load_processor

from meshserve.proto.v1 import common_pb2, tokenizer_pb2
from meshserve.services.tokenizer.images import load_image_placeholders
from meshserve.services.tokenizer.loader import load_tokenizer
from meshserve.services.tokenizer.model import ServedModel
from meshserve.services.tokenizer.service import TokenizerServicer

IMAGE_TOKEN = 300
PATCH = 16  # the fake model's image tokens: one per 16x16 pixels


def image_tokens(width: int, height: int) -> int:
    return math.ceil(width / PATCH) * math.ceil(height / PATCH)


class VisionTokenizer(FakeTokenizer):
    """Byte-level text; each `{"type": "image"}` part becomes image_tokens(size) IMAGE_TOKENs,
    sized by the next of TokenizeRequest.images. `ranges_dropped`: answer one range too few."""

    def __init__(self) -> None:
        super().__init__()
        self.ranges_dropped = False

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        self.tokenize_calls.append(request)
        sizes = list(request.images)
        ids: list[int] = []
        ranges: list[common_pb2.PlaceholderRange] = []
        for message in request.chat.messages:
            ids += f"<{message.role}>".encode()
            parts = (orjson.loads(message.content_parts_json) if message.content_parts_json
                     else [{"type": "text", "text": message.content}])
            for part in parts:
                if part["type"] == "image":
                    size = sizes.pop(0)
                    count = image_tokens(size.width, size.height)
                    ranges.append(common_pb2.PlaceholderRange(offset=len(ids), length=count))
                    ids += [IMAGE_TOKEN] * count
                else:
                    ids += part["text"].encode()
            ids += b"\n"
        ids += b"<assistant>"
        assert not sizes, "every size has its image part"
        return tokenizer_pb2.TokenizeResponse(
            token_ids=ids, prompt_text="(chat)", max_model_len=4096,
            image_ranges=ranges[:-1] if self.ranges_dropped else ranges)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@asynccontextmanager
async def serving(**config: Any) -> AsyncIterator[tuple[Mesh, AsyncOpenAI, ImageServer]]:
    async with image_server() as server, \
            start_mesh(tokenizer=VisionTokenizer(), **config) as mesh, \
            AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0) as api:
        yield mesh, api, server


async def test_the_tokenizer_gets_image_parts_and_sizes_the_worker_gets_the_images() -> None:
    async with serving(allow_private_media_urls=True) as (mesh, api, server):
        messages: Any = [
            {"role": "user", "content": [{"type": "text", "text": "one"},
                                         image(data_url(PNG))]},
            {"role": "assistant", "content": "seen"},
            {"role": "user", "content": [image(server.url("/cat.jpg")),
                                         {"type": "text", "text": "and this?"}]}]
        result = await api.chat.completions.create(model=MODEL, messages=messages)
        assert result.choices[0].message.content == script(0)
        [call] = mesh.tokenizer.tokenize_calls
        assert [(s.width, s.height) for s in call.images] == [(32, 24), (40, 30)]
        assert [orjson.loads(m.content_parts_json) if m.content_parts_json else m.content
                for m in call.chat.messages] == [
            [{"type": "text", "text": "one"}, {"type": "image"}], "seen",
            [{"type": "image"}, {"type": "text", "text": "and this?"}]]
        [request] = mesh.worker.requests
        prompt = request.prompts[0]
        assert [(i.data, i.hash) for i in prompt.images] == [
            (PNG, hashlib.sha256(PNG).digest()), (JPEG, hashlib.sha256(JPEG).digest())]
        first = len(b"<user>one")
        second = first + image_tokens(32, 24) + len(b"\n<assistant>seen\n<user>")
        assert [(i.range.offset, i.range.length) for i in prompt.images] == [
            (first, image_tokens(32, 24)), (second, image_tokens(40, 30))]
        for placed in prompt.images:
            run = prompt.token_ids[placed.range.offset:placed.range.offset + placed.range.length]
            assert set(run) == {IMAGE_TOKEN}
        # The scheduler hashes the same images into the prompt's blocks as the worker does.
        [route] = mesh.scheduler.routes
        assert [(i.hash, i.range) for i in route.images] == [(i.hash, i.range)
                                                              for i in prompt.images]
        assert result.usage is not None
        assert result.usage.prompt_tokens == len(prompt.token_ids)
        assert server.hits == [("127.0.0.1", "/cat.jpg")]


async def test_a_bad_image_is_a_400_naming_it_and_the_request_beside_it_is_served() -> None:
    async with serving() as (mesh, api, server):  # default: no private addresses
        good: Any = [{"role": "user", "content": [image(data_url(PNG)),
                                                  {"type": "text", "text": "hi"}]}]
        bad: Any = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                 image(server.url("/cat.png"))]}]
        served, refused = await asyncio.gather(
            api.chat.completions.create(model=MODEL, messages=good),
            api.chat.completions.create(model=MODEL, messages=bad), return_exceptions=True)
        assert not isinstance(served, BaseException)
        assert served.choices[0].message.content == script(0)
        assert isinstance(refused, BadRequestError)
        body: Any = refused.body
        assert body["type"] == "invalid_request_error"
        assert body["param"] == "messages[0].content[1]"
        assert "127.0.0.1, a loopback address" in body["message"]
        assert server.hits == []
        assert len(mesh.worker.requests) == 1 and len(mesh.tokenizer.tokenize_calls) == 1
        for content, words in (([image("data:image/png;base64,aGVsbG8=")], "not a PNG"),
                               ([image(data_url(PNG[:40]))], "PNG file is truncated"),
                               ([image("ftp://127.0.0.1/x.png")], "only http, https")):
            with pytest.raises(BadRequestError, match=words):
                await api.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": content}])


async def test_limit_mm_per_prompt_is_the_gateways_flag() -> None:
    async with serving(limit_mm_per_prompt='{"image": 1}') as (mesh, api, _):
        content: Any = [image(data_url(PNG)), image(data_url(PNG))]
        with pytest.raises(BadRequestError, match="At most 1 image"):
            await api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}])
        assert mesh.tokenizer.tokenize_calls == []


async def test_tokenize_counts_image_tokens() -> None:
    async with serving() as (mesh, _, _), aiohttp.ClientSession(mesh.base_url) as http:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, image(data_url(JPEG, "image/jpeg"))]}]}
        async with http.post("/tokenize", json=chat) as resp:
            assert resp.status == 200
            tokens = (await resp.json())["tokens"]
        assert tokens == [*b"<user>x", *[IMAGE_TOKEN] * image_tokens(40, 30),
                          *b"\n<assistant>"]
        [call] = mesh.tokenizer.tokenize_calls
        assert [(s.width, s.height) for s in call.images] == [(40, 30)]


async def test_a_tokenizer_that_misplaces_images_is_an_internal_error() -> None:
    async with serving() as (mesh, api, _):
        mesh.tokenizer.ranges_dropped = True
        with pytest.raises(InternalServerError, match=r"answered 0 image range\(s\) for the 1"):
            await api.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": [image(data_url(PNG))]}])
        assert mesh.worker.requests == []


async def test_responses_input_images_reach_the_worker() -> None:
    async with serving() as (mesh, api, _):
        answer = await api.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what is it?"},
            {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"}]}])
        assert answer.output_text == script(0)
        [request] = mesh.worker.requests
        assert [i.data for i in request.prompts[0].images] == [PNG]


async def test_through_the_real_tokenizer_the_ranges_are_the_processors(
        tmp_path: Path) -> None:
    # The tiny LLaVA-NeXT folder's own tokenizer service, in process: its ranges for the sizes
    # the gateway decoded cover the placeholders transformers' processor makes for images
    # of those sizes, and the worker gets them with the files.
    folder = build_tiny_vlm(tmp_path, "llava_next")  # placeholders by image size
    tokenizer = load_tokenizer(folder)
    served = ServedModel(tokenizer, (MODEL,), 4096,
                         images=load_image_placeholders(folder, tokenizer.hf))
    tall = picture("PNG", (40, 120))
    async with image_server() as server, \
            start_mesh(tokenizer=TokenizerServicer(served), allow_private_media_urls=True,
                       served_model_names=(MODEL,)) as mesh, \
            AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="x", max_retries=0) as api:
        messages: Any = [{"role": "user", "content": [
            {"type": "text", "text": "Compare"}, image(server.url("/cat.jpg")),
            {"type": "text", "text": "with"}, image(data_url(tall))]}]
        await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        prompt = mesh.worker.requests[0].prompts[0]
        chat = ImageChat("sent", [{"role": "user", "content": [
            text("Compare"), IMAGE, text("with"), IMAGE]}], [(40, 30), (40, 120)])
        expected = reference(load_processor(folder), "llava_next", chat)
        assert list(prompt.token_ids) == expected.token_ids
        covered = [p for i in prompt.images
                   for p in range(i.range.offset, i.range.offset + i.range.length)]
        assert covered == expected.image_positions
        assert prompt.images[0].range.length != prompt.images[1].range.length  # by size
        assert [i.data for i in prompt.images] == [JPEG, tall]
