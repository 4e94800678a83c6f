"""Protobuf <-> domain conversions of the scheduler's edge."""

from __future__ import annotations

import asyncio

from meshserve.proto.v1 import common_pb2, scheduler_pb2
from meshserve.services.scheduler.router import RouteDecision, RouteQuery
from meshserve.shared.block_hash import ImageSpan
from meshserve.shared.worker_registry import (
    ROLE_DECODE,
    ROLE_MIXED,
    ROLE_PREFILL,
    RUNNER_GENERATE,
    RUNNER_POOLING,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
)

# The proto's Runner enum <-> the registry's runner names (UNSPECIFIED: generate).
_RUNNER_NAMES = {common_pb2.RUNNER_UNSPECIFIED: RUNNER_GENERATE,
                 common_pb2.RUNNER_GENERATE: RUNNER_GENERATE,
                 common_pb2.RUNNER_POOLING: RUNNER_POOLING}
_RUNNER_ENUMS = {RUNNER_GENERATE: common_pb2.RUNNER_GENERATE,
                 RUNNER_POOLING: common_pb2.RUNNER_POOLING}


_ROLE_NAMES = {common_pb2.WORKER_ROLE_PREFILL: ROLE_PREFILL,
               common_pb2.WORKER_ROLE_DECODE: ROLE_DECODE}
_ROLE_ENUMS = {ROLE_MIXED: common_pb2.WORKER_ROLE_MIXED,
               ROLE_PREFILL: common_pb2.WORKER_ROLE_PREFILL,
               ROLE_DECODE: common_pb2.WORKER_ROLE_DECODE}


def runner_name(value: common_pb2.Runner) -> str:
    """The registry's name of a proto Runner value (an unknown value is generate's)."""
    return _RUNNER_NAMES.get(value, RUNNER_GENERATE)


def lora_adapters_pb(info: WorkerInfo) -> list[common_pb2.LoraAdapter]:
    """The adapters of a worker's info as proto LoraAdapters (parent: its first name)."""
    base = info.model_names[0] if info.model_names else ""
    return [common_pb2.LoraAdapter(name=name, id=lora_id, base_model_name=base)
            for name, lora_id in zip(info.lora_names, info.lora_ids, strict=False)]


def info_from_proto(msg: common_pb2.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        worker_id=msg.worker_id, address=msg.address, model_names=tuple(msg.model_names),
        block_size=msg.block_size, max_model_len=msg.max_model_len,
        num_total_blocks=msg.num_total_blocks, lora_ids=tuple(a.id for a in msg.loras) or tuple(
            msg.lora_ids), lora_names=tuple(a.name for a in msg.loras),
        tensor_parallel_size=msg.tensor_parallel_size or 1, kv_namespace=msg.kv_namespace,
        sampling_defaults_json=msg.sampling_defaults_json, epoch=msg.epoch,
        runner=runner_name(msg.runner), embedding_size=msg.embedding_size,
        class_labels=tuple(msg.class_labels), metrics_url=msg.metrics_url,
        role=_ROLE_NAMES.get(msg.role, ROLE_MIXED), kv_handoff_address=msg.kv_handoff_address)


def load_from_proto(msg: common_pb2.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        num_running=msg.num_running, num_waiting=msg.num_waiting,
        num_pending_prefill_tokens=msg.num_pending_prefill_tokens,
        num_used_blocks=msg.num_used_blocks, num_free_blocks=msg.num_free_blocks,
        num_total_blocks=msg.num_total_blocks, max_running=msg.max_running,
        draining=msg.draining, snapshot_unix_ns=msg.snapshot_unix_ns,
        num_active_tokens=msg.num_active_tokens)


def record_to_proto(record: WorkerRecord) -> scheduler_pb2.WorkerStatus:
    info, load = record.info, record.load
    return scheduler_pb2.WorkerStatus(
        info=common_pb2.WorkerInfo(
            worker_id=info.worker_id, epoch=record.epoch, address=info.address,
            model_names=info.model_names, block_size=info.block_size,
            max_model_len=info.max_model_len, num_total_blocks=info.num_total_blocks,
            lora_ids=info.lora_ids, tensor_parallel_size=info.tensor_parallel_size,
            loras=lora_adapters_pb(info),
            kv_namespace=info.kv_namespace,
            sampling_defaults_json=info.sampling_defaults_json, runner=_RUNNER_ENUMS[info.runner],
            embedding_size=info.embedding_size, class_labels=info.class_labels,
            metrics_url=info.metrics_url, role=_ROLE_ENUMS[info.role],
            kv_handoff_address=info.kv_handoff_address),
        load=common_pb2.WorkerLoad(
            worker_id=info.worker_id, epoch=record.epoch, num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_pending_prefill_tokens=load.num_pending_prefill_tokens,
            num_used_blocks=load.num_used_blocks, num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks, max_running=load.max_running,
            draining=load.draining, snapshot_unix_ns=load.snapshot_unix_ns,
            num_active_tokens=load.num_active_tokens),
        last_heartbeat_unix_ns=record.last_heartbeat_unix_ns)


def query_from_proto(msg: scheduler_pb2.RouteRequest, wait_s: float) -> RouteQuery:
    """The domain query; it gives up waiting after `wait_s` (from now)."""
    return RouteQuery(
        request_id=msg.request_id, model=msg.model,
        prompt_token_ids=tuple(msg.prompt_token_ids), block_hashes=tuple(msg.block_hashes),
        num_prompt_tokens=msg.num_prompt_tokens,
        lora_id=msg.lora_id if msg.HasField("lora_id") else None, cache_salt=msg.cache_salt,
        priority=msg.priority, deadline=asyncio.get_running_loop().time() + wait_s,
        expected_output_tokens=msg.expected_output_tokens,
        num_sequences=max(1, msg.num_sequences),
        exclude_worker_ids=frozenset(msg.exclude_worker_ids), runner=runner_name(msg.runner),
        images=tuple(ImageSpan(image.range.offset, image.range.length, image.hash)
                     for image in msg.images),
        max_queue_delay_s=max(0.0, msg.max_queue_delay_s))


def decision_to_proto(decision: RouteDecision) -> scheduler_pb2.RouteResponse:
    return scheduler_pb2.RouteResponse(
        worker_id=decision.worker_id, address=decision.address, epoch=decision.epoch,
        num_matched_blocks=decision.num_matched_blocks,
        num_kvstore_blocks=decision.num_kvstore_blocks, block_size=decision.block_size,
        queued_ns=decision.queued_ns, policy=decision.policy, score=decision.score,
        num_prompt_blocks=decision.num_prompt_blocks, num_running=decision.num_running,
        num_waiting=decision.num_waiting, num_used_blocks=decision.num_used_blocks,
        decode=None if decision.decode is None else scheduler_pb2.HandoffTarget(
            worker_id=decision.decode.worker_id, address=decision.decode.address,
            epoch=decision.decode.epoch, kv_address=decision.decode.kv_address))


def decision_attributes(decision: RouteDecision) -> dict[str, str | int | float]:
    """The route span's attributes: the chosen worker, its overlaps and load, the policy."""
    return {
        "meshserve.worker_id": decision.worker_id,
        "meshserve.matched_blocks": decision.num_matched_blocks,
        "meshserve.kvstore_blocks": decision.num_kvstore_blocks,
        "meshserve.prompt_blocks": decision.num_prompt_blocks,
        "meshserve.queued_ns": decision.queued_ns,
        "meshserve.routing.policy": decision.policy,
        "meshserve.routing.score": decision.score,
        "meshserve.worker.num_running": decision.num_running,
        "meshserve.worker.num_waiting": decision.num_waiting,
        "meshserve.worker.num_used_blocks": decision.num_used_blocks,
    }
