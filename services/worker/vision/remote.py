"""Image rows from encoder services (services/encoder/), fetched while requests wait.

`RemoteRows.fetch` sends a request's images to an encoder replica (round robin), a few a
call; the ImageEncoder (encoder.py) calls it on a thread of its own when the request reaches
the engine thread, which admits the request once the rows are in (engine_thread.py's
`_prepare`): the engine loop never waits for the call. On one host the rows come back through
shared-memory files, else in the message. A replica that fails is skipped for the next call;
when every one fails, the worker's own vision half encodes instead, or, without it, the
request fails with UNAVAILABLE.
"""

from __future__ import annotations

import ipaddress
import itertools
import threading
from collections.abc import Sequence

import grpc
import torch

from meshserve.proto.v1 import encoder_pb2, encoder_pb2_grpc
from meshserve.services.worker.engine.images import PromptImage
from meshserve.shared.errors import UnavailableError
from meshserve.shared.grpc_client import GrpcClient, error_from_rpc
from meshserve.shared.rows_files import read_rows_file

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# What an encoder refuses because of the image (a 400 for the request), not its own state.
_IMAGE_ERRORS = ("invalid_request",)


def on_this_host(address: str) -> bool:
    """Whether `address` (host:port) names this host: loopback or localhost."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rows_of(answer: encoder_pb2.ImageEmbedding) -> torch.Tensor:
    """An answer's rows [R, H] (on the CPU), from its file or its bytes."""
    dtype = _DTYPES.get(answer.dtype)
    if dtype is None:
        raise UnavailableError(f"the encoder answered rows of type {answer.dtype!r}")
    if answer.WhichOneof("payload") == "shm_path":
        return read_rows_file(answer.shm_path, answer.rows, answer.hidden_size, dtype)
    flat = torch.frombuffer(bytearray(answer.data), dtype=dtype)
    return flat.view(answer.rows, answer.hidden_size)


class RemoteRows:
    """Rows of admitted requests' images from encoder services, kept until taken."""

    def __init__(self, addresses: Sequence[str], model: str, *,
                 shared_memory: bool | None = None, timeout_s: float = 60.0,
                 images_per_call: int = 4) -> None:
        """`shared_memory` None: for the replicas on this host (loopback addresses)."""
        assert addresses, "RemoteRows needs at least one encoder address"
        client = GrpcClient()
        self._targets = [(encoder_pb2_grpc.EncoderStub(grpc.insecure_channel(
            address, options=client.channel_options())),
            on_this_host(address) if shared_memory is None else shared_memory)
            for address in addresses]
        self._model = model
        self._timeout_s = timeout_s
        self._images_per_call = images_per_call
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._ready: dict[bytes, torch.Tensor] = {}
        self.calls = 0  # answered
        self.calls_failed = 0

    def fetch(self, images: Sequence[PromptImage], *, must_succeed: bool = False) -> bool:
        """Fetch `images`' rows (blocking: the caller's thread is not the engine's): True
        once they are in, False when every replica failed (the caller encodes them itself;
        with `must_succeed` UnavailableError instead); the MeshError of an image the
        encoder refused."""
        return self._fetch(list(images), must_succeed)

    def encode(self, files: Sequence[tuple[bytes, bytes]]) -> dict[bytes, torch.Tensor]:
        """A RowsSource: fetch now and wait (when rows fetched ahead were evicted)."""
        images = [PromptImage(data, digest, 0, 1) for digest, data in files]
        self._fetch(images, True)
        rows = {digest: self.take(digest) for digest, _ in files}
        return {digest: r for digest, r in rows.items() if r is not None}

    def take(self, digest: bytes) -> torch.Tensor | None:
        """The fetched rows of an image (given once), or None."""
        with self._lock:
            return self._ready.pop(digest, None)

    def _fetch(self, images: list[PromptImage], must_succeed: bool) -> bool:
        unique = list({image.digest: image.data for image in images}.items())
        # A few images a call: rows answered in the message stay far below its size limit
        # (a 7B LLaVA image is 4.7 MB of bf16 rows).
        calls = [unique[i:i + self._images_per_call]
                 for i in range(0, len(unique), self._images_per_call)]
        return all(self._fetch_call(call, must_succeed) for call in calls)

    def _fetch_call(self, files: list[tuple[bytes, bytes]], must_succeed: bool) -> bool:
        start = next(self._turn)
        for k in range(len(self._targets)):
            stub, shared = self._targets[(start + k) % len(self._targets)]
            request = encoder_pb2.EncodeRequest(
                model=self._model, shared_memory=shared,
                images=[encoder_pb2.EncodeImage(data=data, hash=digest)
                        for digest, data in files])
            try:
                answer = stub.Encode(request, timeout=self._timeout_s)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if error.kind in _IMAGE_ERRORS:
                    raise error from exc
                self.calls_failed += 1
                continue
            with self._lock:
                self.calls += 1
                for embedding in answer.embeddings:
                    self._ready[embedding.hash] = rows_of(embedding)
            return True
        if must_succeed:
            raise UnavailableError(f"no encoder service answered "
                                   f"({len(self._targets)} tried)")
        return False
