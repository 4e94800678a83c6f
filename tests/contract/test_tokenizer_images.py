"""Contract tests of images through the Tokenizer service: the real service process
(`python -m meshserve.services.tokenizer`, torch forbidden as its main() does) over each
tiny vision-language folder of tests/tiny_vlm.py, on 127.0.0.1.

The reference is the folder's own transformers processor in this process: token ids of
`processor(text=rendered, images=[images of those sizes])`, and the positions of its image
placeholder token, which `TokenizeResponse.image_ranges` must cover exactly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import orjson
import pytest
from image_prompts import CHATS, IMAGE, ImageChat, reference, text
from service_process import free_port, service_process
from tiny_vlm import VLM_FAMILIES, build_tiny_vlm, load_processor
from tokenizer_harness import Harness
from transformers import ProcessorMixin

from meshserve.proto.v1 import tokenizer_pb2 as pb
from meshserve.proto.v1 import tokenizer_pb2_grpc
from meshserve.services.tokenizer.service import SERVICE_NAME
from meshserve.shared.grpc_client import GrpcClient, error_from_rpc

NAME = "tiny-vlm"


@dataclass(frozen=True)
class Service:
    family: str
    port: int
    processor: ProcessorMixin


@pytest.fixture(scope="module", params=VLM_FAMILIES)
def service(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    family = request.param
    folder = build_tiny_vlm(tmp_path_factory.mktemp(family), family)
    with service_process("tokenizer", [
            "--model", str(folder), "--served-model-name", NAME, "--max-model-len", "256",
            "--metrics-port", str(free_port())], SERVICE_NAME) as address:
        yield Service(family, int(address.rsplit(":", 1)[1]), load_processor(folder))


@pytest.fixture
async def stub(service: Service) -> AsyncIterator[tokenizer_pb2_grpc.TokenizerStub]:
    channel = GrpcClient().channel(f"127.0.0.1:{service.port}")
    yield tokenizer_pb2_grpc.TokenizerStub(channel)
    await channel.close()


def _request(chat: ImageChat, model: str = NAME, **fields: object) -> pb.TokenizeRequest:
    messages = [pb.ChatMessage(role=m["role"], content=m["content"])
                if isinstance(m["content"], str) else
                pb.ChatMessage(role=m["role"], content_parts_json=orjson.dumps(m["content"]))
                for m in chat.messages]
    return pb.TokenizeRequest(model=model, chat=pb.ChatMessages(messages=messages),
                              images=[pb.ImageSize(width=w, height=h) for w, h in chat.sizes],
                              **fields)  # type: ignore[arg-type]


async def _refusal(call: object) -> tuple[str, str | None, str]:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = error_from_rpc(raised.value)
    return error.kind, error.param, error.message


@pytest.mark.parametrize("chat", CHATS, ids=[chat.name for chat in CHATS])
async def test_tokenize_equals_the_processor(service: Service,
                                             stub: tokenizer_pb2_grpc.TokenizerStub,
                                             chat: ImageChat) -> None:
    want = reference(service.processor, service.family, chat)
    reply = await stub.Tokenize(_request(chat))
    assert reply.prompt_text == want.text
    assert list(reply.token_ids) == want.token_ids
    assert len(reply.image_ranges) == len(chat.sizes)
    covered = [i for r in reply.image_ranges for i in range(r.offset, r.offset + r.length)]
    assert covered == want.image_positions
    count = await stub.CountTokens(pb.CountTokensRequest(prompt=_request(chat)))
    assert count.count == len(want.token_ids)  # the image tokens counted


async def test_images_that_do_not_fit_the_chat_are_refused(
        service: Service, stub: tokenizer_pb2_grpc.TokenizerStub) -> None:
    chat = CHATS[1]
    fewer = ImageChat("fewer", chat.messages, chat.sizes[:1])
    kind, param, message = await _refusal(stub.Tokenize(_request(fewer)))
    assert (kind, param) == ("invalid_request", "images")
    assert "2 image parts but 1 image sizes" in message
    marked = ImageChat("marked", [{"role": "user", "content": [
        text(f"see {service.processor.image_token}"), IMAGE]}], [(30, 30)])
    _, param, message = await _refusal(stub.Tokenize(_request(marked)))
    assert param == "images" and "2 image markers" in message
    whole = await stub.Tokenize(_request(CHATS[2]))
    keep = len(whole.token_ids) - whole.image_ranges[0].offset - 1
    _, param, message = await _refusal(stub.Tokenize(_request(
        CHATS[2], truncate_prompt_tokens=keep)))
    assert param == "truncate_prompt_tokens" and "cut into the prompt's images" in message
    _, param, _ = await _refusal(stub.Tokenize(pb.TokenizeRequest(
        text="hello", images=[pb.ImageSize(width=8, height=8)])))
    assert param == "images"


async def test_a_text_only_model_refuses_images(harness: Harness) -> None:
    kind, param, message = await _refusal(harness.stub.Tokenize(_request(CHATS[0], "")))
    assert (kind, param) == ("invalid_request", "messages")
    assert "does not take images" in message and "tiny" in message
    _, param, _ = await _refusal(harness.stub.CountTokens(pb.CountTokensRequest(
        prompt=_request(ImageChat("sizes only", CHATS[3].messages, [(8, 8)]), "tiny"))))
    assert param == "images"


def test_the_folders_name_their_processor(tmp_path: Path) -> None:
    # What the service reads to know the family: processor_config.json's processor_class.
    folder = build_tiny_vlm(tmp_path / "q", "qwen2_5_vl")
    config = orjson.loads((folder / "processor_config.json").read_bytes())
    assert config["processor_class"] == "Qwen2_5_VLProcessor"
