"""Protobuf <-> the store's domain types, at the servicer's edge."""

from __future__ import annotations

from collections.abc import Iterator
from types import MappingProxyType

from meshserve.proto.v1 import kvstore_pb2
from meshserve.services.kvstore.blocks import (
    BlockMeta,
    HeldBlock,
    PutOutcome,
    Reserved,
    ReserveOutcome,
    StoredBlock,
)
from meshserve.shared.errors import InvalidRequestError

DTYPE_BY_ENUM = MappingProxyType({
    kvstore_pb2.KV_DTYPE_FLOAT16: "float16",
    kvstore_pb2.KV_DTYPE_BFLOAT16: "bfloat16",
    kvstore_pb2.KV_DTYPE_FLOAT32: "float32",
    kvstore_pb2.KV_DTYPE_FLOAT8_E4M3FN: "float8_e4m3fn",
    kvstore_pb2.KV_DTYPE_FLOAT8_E5M2: "float8_e5m2",
})
ENUM_BY_DTYPE = MappingProxyType({name: value for value, name in DTYPE_BY_ENUM.items()})

RESERVE_STATUS = MappingProxyType({
    ReserveOutcome.RESERVED: kvstore_pb2.RESERVE_STATUS_RESERVED,
    ReserveOutcome.HELD: kvstore_pb2.RESERVE_STATUS_HELD,
    ReserveOutcome.PENDING: kvstore_pb2.RESERVE_STATUS_PENDING,
    ReserveOutcome.REFUSED: kvstore_pb2.RESERVE_STATUS_REFUSED,
    ReserveOutcome.BYTES_ONLY: kvstore_pb2.RESERVE_STATUS_BYTES_ONLY,
})


def dtype_from_proto(value: kvstore_pb2.KVDType, block_hash: bytes = b"") -> str:
    dtype = DTYPE_BY_ENUM.get(value)
    if dtype is None:
        raise InvalidRequestError(f"block {block_hash.hex()[:16]}: dtype must be set "
                                  f"(got {value})", param="dtype")
    return dtype


def block_from_proto(msg: kvstore_pb2.KVBlock) -> StoredBlock:
    return StoredBlock(block_hash=msg.block_hash, data=msg.data,
                   dtype=dtype_from_proto(msg.dtype, msg.block_hash), shape=tuple(msg.shape),
                   parent_hash=msg.parent_hash)


def block_to_proto(block: StoredBlock) -> kvstore_pb2.KVBlock:
    return kvstore_pb2.KVBlock(block_hash=block.block_hash, parent_hash=block.parent_hash,
                               data=block.data, dtype=ENUM_BY_DTYPE[block.dtype],
                               shape=block.shape)


def metas_from_reserve(request: kvstore_pb2.ReserveRequest) -> list[BlockMeta]:
    """One BlockMeta per hash of a Reserve request (all of one dtype and shape)."""
    hashes = list(request.block_hashes)
    parents = list(request.parent_hashes) or [b""] * len(hashes)
    if len(parents) != len(hashes):
        raise InvalidRequestError(f"{len(parents)} parent_hashes for {len(hashes)} "
                                  f"block_hashes (give none or one per block)",
                                  param="parent_hashes")
    dtype = dtype_from_proto(request.dtype)
    shape = tuple(request.shape)
    return [BlockMeta(h, dtype, shape, p) for h, p in zip(hashes, parents, strict=True)]


def reserve_to_proto(reserved: Reserved, block_bytes: int) -> kvstore_pb2.ReserveResponse:
    return kvstore_pb2.ReserveResponse(
        reservation_id=reserved.reservation_id,
        status=[RESERVE_STATUS[outcome] for outcome in reserved.outcomes],
        offsets=reserved.offsets, block_bytes=block_bytes)


def commit_to_proto(outcomes: list[PutOutcome] | None) -> kvstore_pb2.CommitResponse:
    if outcomes is None:
        return kvstore_pb2.CommitResponse(expired=True)
    return kvstore_pb2.CommitResponse(num_stored=outcomes.count(PutOutcome.STORED),
                                      num_present=outcomes.count(PutOutcome.PRESENT))


def acquired_to_proto(block: HeldBlock) -> kvstore_pb2.AcquiredBlock:
    meta = block.meta
    return kvstore_pb2.AcquiredBlock(
        block_hash=meta.block_hash, parent_hash=meta.parent_hash,
        dtype=ENUM_BY_DTYPE[meta.dtype], shape=meta.shape,
        in_region=block.offset is not None, offset=block.offset or 0)


def batches(blocks: list[HeldBlock], max_bytes: int) -> Iterator[list[HeldBlock]]:
    """Consecutive runs of blocks of at most `max_bytes` of data (a larger block alone)."""
    batch: list[HeldBlock] = []
    size = 0
    for block in blocks:
        nbytes = block.meta.nbytes
        if batch and size + nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(block)
        size += nbytes
    if batch:
        yield batch
