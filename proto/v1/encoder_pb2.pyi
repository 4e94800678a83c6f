from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeImage(_message.Message):
    __slots__ = ("data", "hash")
    DATA_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    hash: bytes
    def __init__(self, data: _Optional[bytes] = ..., hash: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("model", "images", "shared_memory")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    model: str
    images: _containers.RepeatedCompositeFieldContainer[EncodeImage]
    shared_memory: bool
    def __init__(self, model: _Optional[str] = ..., images: _Optional[_Iterable[_Union[EncodeImage, _Mapping]]] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class ImageEmbedding(_message.Message):
    __slots__ = ("hash", "rows", "hidden_size", "dtype", "data", "shm_path")
    HASH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    rows: int
    hidden_size: int
    dtype: str
    data: bytes
    shm_path: str
    def __init__(self, hash: _Optional[bytes] = ..., rows: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., shm_path: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings", "encode_ns")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_NS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[ImageEmbedding]
    encode_ns: int
    def __init__(self, embeddings: _Optional[_Iterable[_Union[ImageEmbedding, _Mapping]]] = ..., encode_ns: _Optional[int] = ...) -> None: ...
