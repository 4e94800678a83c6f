from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_FLOAT8_E4M3FN: _ClassVar[KVDType]
    KV_DTYPE_FLOAT8_E5M2: _ClassVar[KVDType]

class ReserveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVE_STATUS_UNSPECIFIED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_RESERVED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_HELD: _ClassVar[ReserveStatus]
    RESERVE_STATUS_PENDING: _ClassVar[ReserveStatus]
    RESERVE_STATUS_REFUSED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_BYTES_ONLY: _ClassVar[ReserveStatus]
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_FLOAT16: KVDType
KV_DTYPE_BFLOAT16: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_FLOAT8_E4M3FN: KVDType
KV_DTYPE_FLOAT8_E5M2: KVDType
RESERVE_STATUS_UNSPECIFIED: ReserveStatus
RESERVE_STATUS_RESERVED: ReserveStatus
RESERVE_STATUS_HELD: ReserveStatus
RESERVE_STATUS_PENDING: ReserveStatus
RESERVE_STATUS_REFUSED: ReserveStatus
RESERVE_STATUS_BYTES_ONLY: ReserveStatus

class KVBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "data", "dtype", "shape")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    data: bytes
    dtype: KVDType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("kv_namespace", "blocks")
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    kv_namespace: str
    blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    def __init__(self, kv_namespace: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_stored", "num_present", "num_rejected")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_present: int
    num_rejected: int
    def __init__(self, num_stored: _Optional[int] = ..., num_present: _Optional[int] = ..., num_rejected: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("kv_namespace", "block_hashes", "prefix_only")
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    kv_namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_only: bool
    def __init__(self, kv_namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prefix_only: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KVBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[KVBlock, _Mapping]]] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("kv_namespace", "block_hashes")
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    kv_namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, kv_namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ContainsResponse(_message.Message):
    __slots__ = ("present", "num_prefix_present")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    num_prefix_present: int
    def __init__(self, present: _Optional[_Iterable[bool]] = ..., num_prefix_present: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks", "used_bytes", "capacity_bytes", "hits", "misses", "evictions", "stored", "slot_bytes", "leases", "reservations", "pinned_blocks", "expired")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    stored: int
    slot_bytes: int
    leases: int
    reservations: int
    pinned_blocks: int
    expired: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., stored: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("shm_path", "region_bytes", "region_token", "slot_bytes", "pid", "host", "store_id", "lease_s")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    region_bytes: int
    region_token: bytes
    slot_bytes: int
    pid: int
    host: str
    store_id: str
    lease_s: float
    def __init__(self, shm_path: _Optional[str] = ..., region_bytes: _Optional[int] = ..., region_token: _Optional[bytes] = ..., slot_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., store_id: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("kv_namespace", "region_token", "block_hashes", "parent_hashes", "dtype", "shape")
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    kv_namespace: str
    region_token: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    dtype: KVDType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_namespace: _Optional[str] = ..., region_token: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hashes: _Optional[_Iterable[bytes]] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "status", "offsets", "block_bytes")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    status: _containers.RepeatedScalarFieldContainer[ReserveStatus]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    def __init__(self, reservation_id: _Optional[int] = ..., status: _Optional[_Iterable[_Union[ReserveStatus, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("region_token", "reservation_id")
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    region_token: bytes
    reservation_id: int
    def __init__(self, region_token: _Optional[bytes] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_stored", "num_present", "expired")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_present: int
    expired: bool
    def __init__(self, num_stored: _Optional[int] = ..., num_present: _Optional[int] = ..., expired: _Optional[bool] = ...) -> None: ...

class AbandonRequest(_message.Message):
    __slots__ = ("region_token", "reservation_id")
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    region_token: bytes
    reservation_id: int
    def __init__(self, region_token: _Optional[bytes] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class AbandonResponse(_message.Message):
    __slots__ = ("abandoned",)
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    abandoned: bool
    def __init__(self, abandoned: _Optional[bool] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("kv_namespace", "region_token", "block_hashes", "prefix_only")
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ONLY_FIELD_NUMBER: _ClassVar[int]
    kv_namespace: str
    region_token: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_only: bool
    def __init__(self, kv_namespace: _Optional[str] = ..., region_token: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prefix_only: _Optional[bool] = ...) -> None: ...

class AcquiredBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "dtype", "shape", "in_region", "offset")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    IN_REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    dtype: KVDType
    shape: _containers.RepeatedScalarFieldContainer[int]
    in_region: bool
    offset: int
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., in_region: _Optional[bool] = ..., offset: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[AcquiredBlock]
    def __init__(self, lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[AcquiredBlock, _Mapping]]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("region_token", "lease_id")
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    region_token: bytes
    lease_id: int
    def __init__(self, region_token: _Optional[bytes] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
