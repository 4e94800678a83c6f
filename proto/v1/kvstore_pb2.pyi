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
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_FLOAT16: KVDType
KV_DTYPE_BFLOAT16: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_FLOAT8_E4M3FN: KVDType
KV_DTYPE_FLOAT8_E5M2: KVDType

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
    __slots__ = ("num_blocks", "used_bytes", "capacity_bytes", "hits", "misses", "evictions", "stored")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    stored: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., stored: _Optional[int] = ...) -> None: ...
