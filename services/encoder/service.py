"""meshserve.v1.Encoder: a vision half served over gRPC (thin: checks, one call, answers).

Encoding runs on one thread of its own, one call after another (the device runs one
forward at a time anyway), never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from meshserve.proto.v1 import encoder_pb2, encoder_pb2_grpc
from meshserve.services.encoder.model import ServedVision
from meshserve.shared.errors import InvalidRequestError, NotFoundError, UnavailableError
from meshserve.shared.rows_files import RowsFiles, rows_bytes
from meshserve.shared.telemetry import Telemetry

SERVICE_NAME = "meshserve.v1.Encoder"
_DTYPE_NAMES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16",
                "torch.float32": "float32"}


@dataclass
class EncoderMetrics:
    """Prometheus metrics of the encoder service."""

    registry: CollectorRegistry
    images: Counter = field(init=False)
    seconds: Histogram = field(init=False)
    in_flight: Gauge = field(init=False)

    def __post_init__(self) -> None:
        self.images = Counter("meshserve:encoder_images", "Images encoded", ["payload"],
                              registry=self.registry)
        self.seconds = Histogram("meshserve:encoder_encode_seconds", "Time to encode one "
                                 "call's images (processor and forward)",
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        # What an autoscaler watches: calls waiting for or in the one encoding thread.
        self.in_flight = Gauge("meshserve:encoder_calls_in_flight", "Encode calls being "
                               "encoded or waiting for the encoding thread",
                               registry=self.registry)


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    """Encodes images with a `ServedVision` (set when loaded; UNAVAILABLE before)."""

    def __init__(self, files: RowsFiles, max_images: int, *,
                 telemetry: Telemetry | None = None) -> None:
        self._vision: ServedVision | None = None
        self._files = files
        self._max_images = max_images
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._tracer = (telemetry.tracer if telemetry is not None
                        else trace.get_tracer("meshserve.encoder"))
        self.metrics = EncoderMetrics(telemetry.registry if telemetry is not None
                                      else CollectorRegistry())

    def set_vision(self, vision: ServedVision) -> None:
        self._vision = vision

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._files.delete_all()

    def _checked(self, request: encoder_pb2.EncodeRequest) -> ServedVision:
        vision = self._vision
        if vision is None:
            raise UnavailableError("the encoder is still loading")
        if request.model and request.model not in vision.names:
            raise NotFoundError(f"the model {request.model!r} is not served here "
                                f"({vision.name})", param="model")
        if not 1 <= len(request.images) <= self._max_images:
            raise InvalidRequestError(f"an Encode call carries 1 to {self._max_images} images, "
                                      f"got {len(request.images)}", param="images")
        for i, image in enumerate(request.images):
            if hashlib.sha256(image.data).digest() != image.hash:
                raise InvalidRequestError(f"image {i}: the hash is not the file's SHA-256",
                                          param="images")
        return vision

    async def Encode(self, request: encoder_pb2.EncodeRequest,
                     context: grpc.aio.ServicerContext) -> encoder_pb2.EncodeResponse:
        vision = self._checked(request)
        files = [(image.hash, image.data) for image in request.images]
        with self._tracer.start_as_current_span("encode") as span:
            span.set_attribute("meshserve.images", len(files))
            started = time.perf_counter_ns()
            with self.metrics.in_flight.track_inprogress():
                rows = await asyncio.get_running_loop().run_in_executor(
                    self._thread, vision.encoder.encode, files)
            spent = time.perf_counter_ns() - started
            span.set_attribute("meshserve.encode_ms", spent / 1e6)
        self.metrics.seconds.observe(spent / 1e9)
        payload = "shm" if request.shared_memory else "bytes"
        self.metrics.images.labels(payload).inc(len(files))
        self._files.expire()
        return encoder_pb2.EncodeResponse(
            embeddings=[self._embedding(digest, rows[digest], request.shared_memory)
                        for digest, _ in files], encode_ns=spent)

    def _embedding(self, digest: bytes, rows: object, shared: bool
                   ) -> encoder_pb2.ImageEmbedding:
        import torch

        assert isinstance(rows, torch.Tensor) and rows.dim() == 2, "rows are [R, H]"
        answer = encoder_pb2.ImageEmbedding(hash=digest, rows=rows.shape[0],
                                            hidden_size=rows.shape[1],
                                            dtype=_DTYPE_NAMES[str(rows.dtype)])
        if shared:
            answer.shm_path = self._files.write(rows)
        else:
            answer.data = rows_bytes(rows)
        return answer
