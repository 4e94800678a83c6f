"""The encoder service (`python -m meshserve.services.encoder`, a real process on
127.0.0.1) against the worker's own vision half, and a worker engine that takes its image
rows from it: tokens equal transformers'.

A tiny LLaVA folder (tests/tiny_vlm.py). The service's rows equal the in-process encoder's
exactly, in the message and through shared-memory files (read once, then gone); a bad hash,
an undecodable file, another model's name and too many images are refused; an engine whose
images are encoded by the service gives transformers' greedy tokens; with the service
gone, `auto` placement encodes in the worker and `encoder` placement fails the request.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from service_process import free_port, service_process
from tiny_vlm import build_tiny_vlm
from transformers import AutoModelForImageTextToText, AutoProcessor
from vlm_reference import hf_vlm_greedy, image_file, run_cases, vlm_case

from meshserve.proto.v1 import encoder_pb2, encoder_pb2_grpc
from meshserve.services.encoder.service import SERVICE_NAME
from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.vision.remote import RemoteRows, rows_of
from meshserve.shared.errors import UnavailableError
from meshserve.shared.grpc_client import error_from_rpc
from meshserve.shared.sampling_params import SamplingParams

NAME = "tiny-llava"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(folder: Path, **overrides: object) -> LLMEngine:
    return build_engine(EngineConfig(model=str(folder), dtype="float32", device="cpu",
                                     num_kv_blocks=64, **overrides))  # type: ignore[arg-type]


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


@dataclass(frozen=True)
class Encoder:
    folder: Path
    address: str
    shm_dir: Path


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Encoder]:
    folder = build_tiny_vlm(tmp_path_factory.mktemp("llava"), "llava", seed=5)
    shm_dir = tmp_path_factory.mktemp("shm")
    with service_process("encoder", [
            "--model", str(folder), "--served-model-name", NAME, "--device", "cpu",
            "--shm-dir", str(shm_dir), "--max-images-per-call", "4"], SERVICE_NAME) as address:
        yield Encoder(folder, address, shm_dir)


def _request(files: list[bytes], shared: bool, model: str = NAME) -> encoder_pb2.EncodeRequest:
    return encoder_pb2.EncodeRequest(model=model, shared_memory=shared, images=[
        encoder_pb2.EncodeImage(data=f, hash=hashlib.sha256(f).digest()) for f in files])


@pytest.mark.parametrize("shared", [False, True])
def test_rows_equal_the_workers_own_vision_half(encoder: Encoder, shared: bool) -> None:
    engine = make_engine(encoder.folder)
    local = engine.runner.images
    assert local is not None and local.local is not None
    files = [image_file(80, 60, 1), image_file(40, 90, 2, "JPEG"), image_file(80, 60, 3)]
    want = local.local.encode([(hashlib.sha256(f).digest(), f) for f in files])
    with grpc.insecure_channel(encoder.address) as channel:
        answer = encoder_pb2_grpc.EncoderStub(channel).Encode(_request(files, shared))
    assert [e.hash for e in answer.embeddings] == [hashlib.sha256(f).digest() for f in files]
    assert answer.encode_ns > 0
    for embedding in answer.embeddings:
        assert embedding.WhichOneof("payload") == ("shm_path" if shared else "data")
        assert (embedding.rows, embedding.hidden_size, embedding.dtype) == (16, 64, "float32")
        rows = rows_of(embedding)
        assert torch.equal(rows, want[embedding.hash])
        if shared:
            assert not Path(embedding.shm_path).exists()  # read once, then deleted
    assert list(encoder.shm_dir.iterdir()) == []


@pytest.mark.parametrize("family", ["llava_next", "qwen2_5_vl", "gemma3"])
def test_every_family_s_service_rows_equal_the_workers(family: str,
                                                       tmp_path: Path) -> None:
    """The other vision-language families through the service process: the same rows as
    the worker model's own vision half, for images of two sizes."""
    folder = build_tiny_vlm(tmp_path / family, family, seed=6)
    files = [image_file(80, 60, 1), image_file(40, 90, 2, "JPEG")]
    local = make_engine(folder).runner.images
    assert local is not None and local.local is not None
    want = local.local.encode([(hashlib.sha256(f).digest(), f) for f in files])
    with service_process("encoder", ["--model", str(folder), "--device", "cpu"],
                         SERVICE_NAME) as address, grpc.insecure_channel(address) as channel:
        answer = encoder_pb2_grpc.EncoderStub(channel).Encode(
            _request(files, False, model=str(folder)))
    assert len(answer.embeddings) == 2
    for embedding in answer.embeddings:
        assert torch.equal(rows_of(embedding), want[embedding.hash])


@pytest.mark.parametrize(("case", "code", "message"), [
    ("hash", grpc.StatusCode.INVALID_ARGUMENT, "not the file's SHA-256"),
    ("bytes", grpc.StatusCode.INVALID_ARGUMENT, "does not decode as an image"),
    ("model", grpc.StatusCode.NOT_FOUND, "is not served here"),
    ("count", grpc.StatusCode.INVALID_ARGUMENT, "1 to 4 images"),
])
def test_bad_calls_are_refused(encoder: Encoder, case: str, code: grpc.StatusCode,
                               message: str) -> None:
    good = image_file(30, 30, 4)
    request = {
        "hash": encoder_pb2.EncodeRequest(model=NAME, images=[
            encoder_pb2.EncodeImage(data=good, hash=bytes(32))]),
        "bytes": _request([b"not an image"], False),
        "model": _request([good], False, model="another-model"),
        "count": _request([good] * 5, False),
    }[case]
    with grpc.insecure_channel(encoder.address) as channel, \
            pytest.raises(grpc.RpcError) as raised:
        encoder_pb2_grpc.EncoderStub(channel).Encode(request)
    assert raised.value.code() == code
    assert message in error_from_rpc(raised.value).message


@pytest.fixture(scope="module")
def chats(encoder: Encoder):
    processor = AutoProcessor.from_pretrained(encoder.folder)
    hf = AutoModelForImageTextToText.from_pretrained(encoder.folder, dtype=torch.float32)
    token = hf.config.image_token_index
    image = {"type": "image"}
    cases = [vlm_case(processor, token, [{"role": "user", "content": [
        image, {"type": "text", "text": f"Picture {i}: what is it?"}]}], [image_file(
            50 + 10 * i, 60, 10 + i)]) for i in range(3)]
    return cases, [hf_vlm_greedy(hf.eval(), case, 6) for case in cases]


def test_an_engine_encoding_through_the_service_equals_transformers(encoder: Encoder,
                                                                    chats) -> None:
    cases, expected = chats
    engine = make_engine(encoder.folder, encoder_addresses=encoder.address,
                         mm_encoder_placement="encoder")
    images = engine.runner.images
    assert images is not None and images.local is None and images.remote is not None
    # Asked ahead, as the engine thread does at admission: the rows are then taken.
    assert images.prefetch(cases[0].images).result(timeout=60) is True
    outputs = run_cases(engine, cases, GREEDY)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(3)] == expected
    assert images.remote.calls_failed == 0 and images.misses == 3


def test_without_the_service_auto_encodes_in_the_worker_and_encoder_fails(
        encoder: Encoder, chats) -> None:
    cases, expected = chats
    gone = f"127.0.0.1:{free_port()}"
    auto = make_engine(encoder.folder, encoder_addresses=gone, mm_encoder_placement="auto")
    images = auto.runner.images
    assert images is not None and images.local is not None and images.remote is not None
    assert images.prefetch(cases[1].images).result(timeout=60) is False
    outputs = run_cases(auto, cases[1:2], GREEDY)
    assert tokens_of(outputs["r0"]) == expected[1]
    assert images.remote.calls_failed == 1
    only = make_engine(encoder.folder, encoder_addresses=gone, mm_encoder_placement="encoder")
    assert only.runner.images is not None
    fetching = only.runner.images.prefetch(cases[2].images)
    assert fetching is not None
    with pytest.raises(UnavailableError, match="no encoder service answered"):
        fetching.result(timeout=60)


def test_a_request_with_many_images_is_split_into_calls(encoder: Encoder) -> None:
    """A few images a call, so that rows answered in the message stay under its limit."""
    from meshserve.services.worker.engine.images import PromptImage

    files = [image_file(20 + i, 30, 40 + i) for i in range(5)]
    remote = RemoteRows([encoder.address], NAME, shared_memory=False, images_per_call=2)
    images = [PromptImage(f, hashlib.sha256(f).digest(), 0, 16) for f in files]
    assert remote.fetch(images) is True
    assert remote.calls == 3 and remote.calls_failed == 0
    assert all(remote.take(image.digest) is not None for image in images)


def test_unread_answer_files_expire(tmp_path: Path) -> None:
    from meshserve.shared.rows_files import RowsFiles, read_rows_file

    files = RowsFiles(tmp_path, ttl_s=5.0)
    kept = files.write(torch.arange(6, dtype=torch.float32).view(2, 3))
    read = files.write(torch.ones(1, 3, dtype=torch.bfloat16))
    assert read_rows_file(read, 1, 3, torch.bfloat16).tolist() == [[1.0, 1.0, 1.0]]
    assert Path(kept).exists() and not Path(read).exists()
    assert files.expire(now=time.monotonic() + 1) == 0  # younger than its time to live
    assert files.expire(now=time.monotonic() + 10) == 1
    assert list(tmp_path.iterdir()) == []
