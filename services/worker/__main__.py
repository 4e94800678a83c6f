"""Run a worker: `python -m meshserve.services.worker --model DIR --scheduler-address H:P`.

Order of life: load the model (logged, in a thread) -> listen (health NOT_SERVING)
-> claim an epoch -> start the engine thread and the KV event publisher -> run one
tiny request (warm-up) -> wait for the grammar preload, settle the heap (gc.freeze)
-> SERVING -> register with the scheduler and heartbeat.
On SIGTERM / SIGINT: NOT_SERVING, deregister, refuse new calls, let in-flight
requests finish within --drain-grace-s (then abort them), stop the engine, flush
KV events and clear this worker's entries from the block index. A device or
engine failure is fatal: NOT_SERVING, deregister, exit 1. The failure, drain and
registration steps, shared with the pooling worker, live in lifecycle.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import redis.asyncio as aioredis
import torch
from prometheus_client import Gauge
from redis.exceptions import RedisError

from meshserve.proto.v1 import worker_pb2_grpc
from meshserve.services.worker.builder import KVTierPlan, build_engine
from meshserve.services.worker.config import WorkerConfig, short_flags
from meshserve.services.worker.engine.device import resolve_device
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.engine.kv_copy import KVCaches
from meshserve.services.worker.heap import settle_heap
from meshserve.services.worker.lora.control import LoraControl, with_loras
from meshserve.services.worker.lora.hook import LoraHook
from meshserve.services.worker.serving.engine_thread import EngineThread
from meshserve.services.worker.serving.idle_trim import IdleTrim, libc_malloc_trim
from meshserve.services.worker.serving.image_metrics import register_image_metrics
from meshserve.services.worker.serving.kv_publisher import KVEventPublisher
from meshserve.services.worker.serving.lifecycle import ProcessLifecycle, run_process
from meshserve.services.worker.serving.role_metrics import register_role_gauges
from meshserve.services.worker.serving.service import WorkerServicer
from meshserve.services.worker.serving.spec_metrics import register_spec_metrics
from meshserve.services.worker.serving.step_trace import write_step_trace
from meshserve.services.worker.serving.vllm_metrics import metrics_url_of, vllm_metrics_of
from meshserve.services.worker.spec.decoder import SpecDecoder
from meshserve.services.worker.tier.handoff import (
    KvHandoff,
    StoreHandoff,
    TcpHandoff,
    register_handoff_metrics,
    register_tcp_metrics,
)
from meshserve.services.worker.tier.kv_tier import KVTier
from meshserve.services.worker.tier.slot_pool import SlotPool
from meshserve.services.worker.tier.store_client import KVStoreClient
from meshserve.services.worker.tier.tcp_blocks import BlockHolder, BlockServer
from meshserve.services.worker.tier.tcp_handoff import TcpTransfer
from meshserve.services.worker.tier.transfer import KVTransfer
from meshserve.shared.errors import UnavailableError
from meshserve.shared.generation_config import sampling_defaults
from meshserve.shared.grpc_server import GrpcServer
from meshserve.shared.kv_events import AllBlocksCleared
from meshserve.shared.kv_index import KVIndex
from meshserve.shared.model_source import tokenizer_folder
from meshserve.shared.redis_server import connect
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.service_main import in_daemon_thread, run_service
from meshserve.shared.telemetry import Telemetry
from meshserve.shared.worker_registry import ROLE_MIXED, ROLE_PREFILL, WorkerInfo, WorkerRegistry

SERVICE_NAME = "meshserve.v1.Worker"
_log = logging.getLogger("meshserve.services.worker")


def load_engine(config: WorkerConfig, kv_tier: KVTierPlan | None = None) -> LLMEngine:
    """Load the model and size the KV cache (blocking; can take minutes for large models)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    started = time.monotonic()
    _log.info("loading model", extra={"model": config.model or "default",
                                      "load_format": config.load_format,
                                      "device": config.device, "dtype": config.dtype,
                                      "torch_threads": torch.get_num_threads()})
    engine = build_engine(config, kv_tier=kv_tier)
    _log.info("engine built", extra={
        "model": engine.source.name, "dtype": str(engine.dtype), "device": str(engine.device),
        "max_model_len": engine.max_model_len, "num_kv_blocks": engine.num_kv_blocks,
        "seconds": round(time.monotonic() - started, 2)})
    return engine


def kv_namespace(model_name: str, engine: LLMEngine) -> str:
    """The KV namespace of this replica: blocks are shareable across replicas of one
    model, dtype and KV cache dtype (and block size, which the hash itself already covers),
    so an FP8-cache worker never exchanges blocks with a bf16 one."""
    dtype = str(engine.dtype).removeprefix("torch.")
    kv_dtype = str(engine.kv_dtype).removeprefix("torch.")
    return f"{model_name}@{dtype}" + ("" if kv_dtype == dtype else f"+kv={kv_dtype}")


# On a GPU, prompt lengths for the warm-up's batch: several prompts in one step take the
# paged prefill kernels, and these lengths cover the Triton specializations (short and long
# prompts, multiples of 16 and others) that the first user requests would otherwise compile.
_WARM_BATCH_LENGTHS = (10, 16, 17, 40, 64, 300, 2100)
_WARM_PREFIX_TAIL = 11  # then one prompt past a cached prefix: the cached-context kernels


async def _run(thread: EngineThread, request_id: str, prompts: list[list[int]]) -> None:
    stream = thread.submit(request_id, prompts, SamplingParams(temperature=0.0, max_tokens=2))
    while await stream.next() is not None:
        pass


async def warm_up(thread: EngineThread) -> None:
    """Run requests through the engine thread before serving: the first forward and
    allocations; on a GPU also the kernels a first batch of prompts, and a prompt past a
    cached prefix, would compile (about a second each on a fresh machine, measured on an
    H100; loadtest/first_prefill_probe.py), so that no user request pays for them."""
    started = time.monotonic()
    await _run(thread, "warmup", [[0]])
    engine = thread.engine
    if engine.device.type == "cuda":
        longest = engine.max_model_len - 2  # room for the two output tokens
        batch = [[(7 * i + j) % 97 + 1 for j in range(min(n, longest))]
                 for i, n in enumerate(_WARM_BATCH_LENGTHS)]
        await _run(thread, "warmup-batch", batch)
        prefix = batch[_WARM_BATCH_LENGTHS.index(64)]
        await _run(thread, "warmup-prefix",
                   [(prefix + [j % 97 + 1 for j in range(_WARM_PREFIX_TAIL)])[:longest]])
    _log.info("engine warm", extra={"seconds": round(time.monotonic() - started, 3)})


async def claim_epoch(redis: aioredis.Redis | None, worker_id: str, url: str) -> int:
    """A fresh epoch for this worker id: the registry's counter, or the clock without Redis."""
    if redis is None:
        return time.time_ns()  # grows across restarts, as an epoch must
    try:
        return await WorkerRegistry(redis, ttl_s=1.0).claim_epoch(worker_id)
    except RedisError as exc:
        raise UnavailableError(f"cannot reach Redis at {url}: {exc}", param="redis_url") from exc


def _load_gauges(telemetry: Telemetry, thread: EngineThread) -> None:
    """Prometheus gauges that read the engine's latest load snapshot at scrape time."""
    for name, help_text, read in (
            ("engine_steps", "Engine steps since start", lambda: thread.steps_delivered),
            ("engine_step_seconds", "Seconds spent in engine steps since start",
             lambda: thread.step_ns_total / 1e9),
            ("engine_tokens", "Tokens the engine produced since start",
             lambda: thread.tokens_delivered),
            ("running", "Sequences running", lambda: thread.load.num_running),
            ("waiting", "Sequences waiting in the local queue", lambda: thread.load.num_waiting),
            ("kv_free_blocks", "Free KV blocks", lambda: thread.load.num_free_blocks),
            ("kv_total_blocks", "All KV blocks", lambda: thread.load.num_total_blocks)):
        Gauge(f"meshserve:worker_{name}", help_text, registry=telemetry.registry
              ).set_function(read)


def _tier_metrics(telemetry: Telemetry, transfer: KVTransfer, engine: LLMEngine) -> None:
    """Prometheus counters of the KV tier, read at scrape time."""
    tier = engine.hook(KVTier)
    assert tier is not None
    for name, help_text, read in (
            ("kvstore_saved_blocks", "KV blocks written to the kvstore",
             lambda: transfer.stats.saved_blocks),
            ("kvstore_skipped_saves", "KV blocks not written: the kvstore held them already",
             lambda: transfer.stats.skipped_saves),
            ("kvstore_dropped_saves", "KV blocks not saved: backlog full or kvstore away",
             lambda: tier.stats.dropped_saves + transfer.stats.failed_saves),
            ("kvstore_probes", "Admissions that asked the kvstore for prompt blocks",
             lambda: tier.stats.probes),
            ("kvstore_loaded_blocks", "KV blocks loaded from the kvstore instead of computed",
             lambda: tier.stats.loaded_blocks),
            ("kvstore_failed_loads", "Loads from the kvstore that failed (recomputed)",
             lambda: tier.stats.failed_loads),
            ("kvstore_saved_bytes", "Bytes written to the kvstore",
             lambda: transfer.stats.saved_bytes),
            ("kvstore_loaded_bytes", "Bytes loaded from the kvstore",
             lambda: transfer.stats.loaded_bytes),
            ("kvstore_load_seconds", "Seconds spent loading blocks from the kvstore",
             lambda: transfer.stats.load_seconds)):
        Gauge(f"meshserve:worker_{name}_total", help_text, registry=telemetry.registry
              ).set_function(read)


class KVStoreLink:
    """The worker's connection to the kvstore, the shared KV tier: built into the engine
    (`plan`), started once the engine's KV namespace is known (`start`)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.address = config.kvstore_address or ""
        self.shm = config.kvstore_shm
        self.backlog_bytes = config.kv_offload_backlog_bytes
        self.namespace = ""  # set by `start`, before the first client connects
        self.transfer: KVTransfer | None = None

    @staticmethod
    def wanted(config: WorkerConfig) -> bool:
        """Whether a store is configured, offloading is on, and the engine can use it."""
        if not config.kvstore_address or not config.kv_offload:
            return False
        if config.tensor_parallel_size > 1:
            _log.warning("the KV tier is off: it does not yet work with --tensor-parallel-size "
                         "> 1 (docs/tensor_parallel.md)")
            return False
        return True

    def plan(self) -> KVTierPlan:
        return KVTierPlan(self.transport, self.backlog_bytes)

    def transport(self, kv_caches: KVCaches) -> KVTransfer:
        self.transfer = KVTransfer(
            lambda: KVStoreClient(self.address, self.namespace, shm=self.shm), kv_caches)
        return self.transfer

    def start(self, namespace: str) -> KVTransfer:
        """Start moving blocks (blocking: the first connection attempt)."""
        assert self.transfer is not None, "the engine was built without this link's plan"
        self.namespace = namespace
        self.transfer.start()
        return self.transfer


class TcpHandoffLink:
    """The direct KV handoff (--kv-handoff tcp or ipc): the KV tier's transport, wrapped
    around the kvstore's when there is one (`plan`); a prefill worker's block listener,
    started with the transfer thread once the worker's address is known (`start`). With
    ipc, the worker's pool is taken from its device here, before the KV cache is sized
    (which then counts it): a prefill worker's held blocks, or the slots a decode worker
    takes pushed blocks into, served by its own listener (`receive_address`)."""

    def __init__(self, config: WorkerConfig, kvstore: KVStoreLink | None) -> None:
        self.config = config
        self.kvstore = kvstore
        self.transfer: TcpTransfer | None = None
        self.server: BlockServer | None = None
        pooled = config.role == ROLE_PREFILL or (config.role != ROLE_MIXED
                                                 and config.kv_handoff_push)
        self.pool = (SlotPool(config.kv_handoff_hold_bytes, resolve_device(config.device))
                     if config.kv_handoff == "ipc" and pooled else None)
        self.receive_address = ""

    def plan(self) -> KVTierPlan:
        """The engine's KV tier over this link's transport. A prefill worker's saves are
        the handoff itself: bounded by what it may hold, not by the kvstore's backlog (one
        step of an 8k-token prompt of the 8B shape is 1 GiB of blocks)."""
        backlog = self.config.kv_offload_backlog_bytes
        if self.config.role == ROLE_PREFILL:
            backlog = max(backlog, self.config.kv_handoff_hold_bytes)
        return KVTierPlan(self._transport, backlog)

    def _transport(self, kv_caches: KVCaches) -> TcpTransfer:
        config = self.config
        release = self.pool.release if self.pool is not None else None
        holder = (BlockHolder(config.kv_handoff_hold_bytes, config.kv_handoff_hold_s,
                              release=release)
                  if config.role == ROLE_PREFILL else None)
        self.transfer = TcpTransfer(
            kv_caches, inner=self.kvstore.transport(kv_caches) if self.kvstore else None,
            holder=holder, pool=self.pool, streams=config.kv_handoff_streams,
            store_backlog_bytes=config.kv_offload_backlog_bytes,
            push=config.kv_handoff == "ipc" and config.role == ROLE_PREFILL)
        return self.transfer

    def start(self, address: str, block_size: int) -> TcpHandoff:
        """Listen (a prefill worker: on the worker's host, advertised as in `address`)
        and start the transfer thread."""
        transfer = self.transfer
        assert transfer is not None, "the engine was built without this link's plan"
        source = ""
        holder = transfer.holder
        if holder is None and self.pool is not None:  # a decode worker's pushed blocks
            holder = BlockHolder(self.config.kv_handoff_hold_bytes,
                                 self.config.kv_handoff_hold_s, release=self.pool.release)
        if holder is not None:
            self.server = BlockServer(holder, self.config.host,
                                      self.config.kv_handoff_port, pool=self.pool)
            self.server.start()
            source = f"{address.rpartition(':')[0]}:{self.server.port}"
        if transfer.holder is None and source:
            self.receive_address = transfer.own_address = source
            transfer.received, source = holder, ""
        transfer.start()
        return TcpHandoff(transfer, block_size, source,
                          timeout_s=self.config.kv_handoff_send_timeout_s,
                          watermark=self.config.kv_handoff_watermark)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.transfer is not None:
            self.transfer.stop()


class WorkerProcess:
    """The pieces of one running worker, wired together (see the module doc)."""

    # Declared here: `life` reads them through callbacks made before they are set.
    thread: EngineThread
    info: WorkerInfo

    def __init__(self, config: WorkerConfig, engine: LLMEngine, telemetry: Telemetry,
                 kvstore: KVStoreLink | None = None, tcp: TcpHandoffLink | None = None
                 ) -> None:
        self.config = config
        self.engine = engine
        self.kvstore = kvstore
        self.tcp = tcp
        self.telemetry = telemetry
        self.server = GrpcServer(config.listen_address, service_names=[SERVICE_NAME],
                                 telemetry=telemetry, grace_s=config.drain_grace_s,
                                 reuse_port=config.reuse_port)
        # Failure, drain and scheduler membership: shared with the pooling worker.
        self.life = ProcessLifecycle(config, self.server, lambda: self.thread.load,
                                     lambda: self.info)
        self.thread = EngineThread(engine, on_fatal=self.life.on_fatal)
        if config.idle_trim_interval_s:
            self.thread.idle_trim = IdleTrim(config.idle_trim_interval_s,
                                             trim=libc_malloc_trim())
        if config.step_trace:
            self.thread.step_trace = []
            engine.time_device()
        names = config.model_names(engine.source.name)
        self.info = WorkerInfo(  # address and epoch are set once the port is bound
            worker_id="pending", address="pending", model_names=tuple(names),
            block_size=engine.block_size, max_model_len=engine.max_model_len,
            num_total_blocks=engine.num_kv_blocks,
            kv_namespace=kv_namespace(names[0], engine),
            sampling_defaults_json=_sampling_defaults(config, engine),
            tensor_parallel_size=engine.parallel.world_size, role=config.role)
        lora = engine.hook(LoraHook)
        self.info = with_loras(self.info, lora.manager if lora is not None else None)
        self.servicer = WorkerServicer(self.thread, self.info, tracer=telemetry.tracer,
                                       registry=telemetry.registry,
                                       draining=lambda: self.life.draining)
        self.servicer.lora = LoraControl(lora.manager if lora is not None else None,
                                         self._update_info)
        worker_pb2_grpc.add_WorkerServicer_to_server(self.servicer, self.server.server)
        self.redis = connect(config.redis_url, client_name="worker") if config.redis_url else None
        self.publisher: KVEventPublisher | None = None
        self.transfer: KVTransfer | None = None
        _load_gauges(telemetry, self.thread)
        register_role_gauges(telemetry.registry, config.role, lambda: self.thread.load)
        self.vllm_metrics = vllm_metrics_of(engine, self.thread, names[0],
                                            telemetry.registry)
        self.servicer.on_params = self.vllm_metrics.observe_params
        register_spec_metrics(telemetry.registry, engine.hook(SpecDecoder), names[0])
        register_image_metrics(telemetry.registry, engine.images, names[0])

    async def _update_info(self, update: Callable[[WorkerInfo], WorkerInfo]) -> None:
        """Change the worker's info (its LoRA adapters) and tell the scheduler."""
        self.info = self.servicer.info = update(self.info)
        if self.life.registration is not None:
            await self.life.registration.announce()

    async def start(self) -> None:
        """Listen, take an identity and an epoch, start the engine, warm up, go SERVING."""
        port = await self.server.start()
        self.server.install_signal_handlers()
        worker_id = self.config.resolved_worker_id(port)
        epoch = await claim_epoch(self.redis, worker_id, self.config.redis_url or "")
        address = self.config.resolved_advertise_address(port)
        self.info = replace(self.info, worker_id=worker_id, epoch=epoch, address=address,
                            metrics_url=metrics_url_of(address, self.telemetry.metrics_port))
        self.servicer.info = self.info
        self.thread.epoch = epoch
        if self.redis is not None:
            index = KVIndex(self.redis, self.info.namespace)
            # Our new epoch makes the index drop what a previous life of this id held.
            await index.apply_events(worker_id, epoch, 0, [AllBlocksCleared()])
            self.publisher = KVEventPublisher(index, worker_id)
            self.publisher.start()
            self.thread.on_kv_events = self.publisher.put
        if self.kvstore is not None:
            kvstore, namespace = self.kvstore, self.info.namespace
            self.transfer = await in_daemon_thread(lambda: kvstore.start(namespace),
                                                   "kv-connect")
            _tier_metrics(self.telemetry, self.transfer, self.engine)
        self.servicer.handoff = self._handoff()
        if self.servicer.handoff is not None:
            register_handoff_metrics(self.telemetry.registry, self.servicer.handoff)
        self.thread.start()
        await warm_up(self.thread)
        # Everything built so far lives as long as the process: the engine, the gRPC
        # server, the KV clients, and what the grammar preload thread loads (the tokenizer
        # and transformers' module tables, ~100k references for a 128k vocabulary), which
        # every full collection would otherwise walk while serving.
        await in_daemon_thread(lambda: settle_heap(self.engine), "settle-heap")
        await self.server.set_serving()
        _log.info("worker serving", extra={"worker_id": worker_id, "epoch": epoch,
                                           "address": self.info.address, "port": port})
        self.life.register()

    def _handoff(self) -> KvHandoff | None:
        """The KV handoff transport (disaggregated serving), started; None without one."""
        if self.tcp is not None:
            handoff = self.tcp.start(self.info.address, self.engine.block_size)
            register_tcp_metrics(self.telemetry.registry, handoff.transfer, self.tcp.server)
            pusher, tier = handoff.transfer.pusher, self.engine.hook(KVTier)
            if pusher is not None and tier is not None:
                pusher.attach(self.engine.watch_layers, tier)
            if self.tcp.receive_address:
                self.info = self.servicer.info = replace(
                    self.info, kv_handoff_address=self.tcp.receive_address)
            return handoff
        transfer = self.transfer
        if transfer is None:
            return None
        return StoreHandoff(transfer.flush, self.engine.block_size,
                            reachable=lambda: transfer.available,
                            timeout_s=self.config.kv_handoff_send_timeout_s,
                            watermark=self.config.kv_handoff_watermark)

    async def run_until_stopped(self) -> None:
        """Serve until SIGTERM (or a fatal error), deregistering as the drain starts."""
        # Idle sessions end as the drain starts; busy ones after their last request.
        await self.life.run_until_stopped(on_drain=self.servicer.wake_sessions)

    async def close(self) -> None:
        """Stop the engine, flush KV events, clear our index entries, close connections."""
        if self.thread.started:
            self.thread.stop()
            try:
                async with asyncio.timeout(10):
                    await self.thread.wait_stopped()
            except TimeoutError:
                _log.warning("engine thread did not stop within 10s")
        self.engine.close()  # its tensor-parallel ranks, if any
        if self.transfer is not None:
            await in_daemon_thread(self.transfer.stop, "kv-transfer-stop")
        if self.tcp is not None:
            await in_daemon_thread(self.tcp.stop, "kv-handoff-stop")
        if self.thread.step_trace is not None and self.config.step_trace:
            path = f"{self.config.step_trace}.{self.info.worker_id}"
            write_step_trace(path, self.thread.step_trace)
            _log.info("engine step trace written", extra={"path": path,
                                                          "steps": len(self.thread.step_trace)})
        if self.publisher is not None:
            await self.publisher.stop()
            await self.publisher.index.clear_holder(self.info.worker_id, self.info.epoch)
        if self.redis is not None:
            await self.redis.aclose()
        await self.life.close()


async def serve(config: WorkerConfig) -> int:
    """Run the worker until stopped and drained; the process exit code."""
    if config.pooling:  # an embedder: no generation engine (pooling_process.py)
        from meshserve.services.worker.pooling.process import serve_pooling

        return await serve_pooling(config, claim_epoch)
    kvstore = KVStoreLink(config) if KVStoreLink.wanted(config) else None
    tcp = TcpHandoffLink(config, kvstore) if config.kv_handoff != "store" else None
    plan = tcp.plan() if tcp is not None else kvstore.plan() if kvstore is not None else None
    return await run_process(
        config, lambda: load_engine(config, plan),
        lambda engine, telemetry: WorkerProcess(config, engine, telemetry, kvstore, tcp),
        "worker stopped after an engine failure: %r")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshserve worker` / `python -m meshserve.services.worker`."""
    args = short_flags(sys.argv[1:] if argv is None else argv)
    return run_service("worker", WorkerConfig, serve, args)


def _sampling_defaults(config: WorkerConfig, engine: LLMEngine) -> str:
    """The model's request defaults (generation config) as JSON, logged when there are any."""
    source = engine.source
    folder = source.path if source.path.is_dir() else None
    if source.gguf_file is not None and config.generation_config == "auto":
        folder = tokenizer_folder(source)  # the GGUF's exported config folder
    defaults = sampling_defaults(folder, config.generation_config,
                                 config.override_generation_config)
    if defaults:
        _log.info("default sampling parameters from the model's generation config (used for "
                 "fields a request leaves out): %s", defaults)
    return json.dumps(defaults) if defaults else ""


if __name__ == "__main__":
    sys.exit(main())

