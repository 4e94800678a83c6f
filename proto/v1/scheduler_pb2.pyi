from meshserve.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("info", "load")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "ttl_s")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    ttl_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _common_pb2.WorkerLoad
    def __init__(self, load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("registered",)
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    registered: bool
    def __init__(self, registered: _Optional[bool] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "block_hashes", "num_prompt_tokens", "lora_id", "cache_salt", "priority", "deadline_unix_ns", "expected_output_tokens", "num_sequences", "exclude_worker_ids", "runner", "images", "max_queue_delay_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    lora_id: int
    cache_salt: str
    priority: int
    deadline_unix_ns: int
    expected_output_tokens: int
    num_sequences: int
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    runner: _common_pb2.Runner
    images: _containers.RepeatedCompositeFieldContainer[RouteImage]
    max_queue_delay_s: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., lora_id: _Optional[int] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., deadline_unix_ns: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., num_sequences: _Optional[int] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., runner: _Optional[_Union[_common_pb2.Runner, str]] = ..., images: _Optional[_Iterable[_Union[RouteImage, _Mapping]]] = ..., max_queue_delay_s: _Optional[float] = ...) -> None: ...

class RouteImage(_message.Message):
    __slots__ = ("hash", "range")
    HASH_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    range: _common_pb2.PlaceholderRange
    def __init__(self, hash: _Optional[bytes] = ..., range: _Optional[_Union[_common_pb2.PlaceholderRange, _Mapping]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("worker_id", "address", "epoch", "num_matched_blocks", "num_kvstore_blocks", "block_size", "queued_ns", "policy", "score", "num_prompt_blocks", "num_running", "num_waiting", "num_used_blocks", "decode")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KVSTORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_NS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    epoch: int
    num_matched_blocks: int
    num_kvstore_blocks: int
    block_size: int
    queued_ns: int
    policy: str
    score: float
    num_prompt_blocks: int
    num_running: int
    num_waiting: int
    num_used_blocks: int
    decode: HandoffTarget
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., num_matched_blocks: _Optional[int] = ..., num_kvstore_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., queued_ns: _Optional[int] = ..., policy: _Optional[str] = ..., score: _Optional[float] = ..., num_prompt_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., decode: _Optional[_Union[HandoffTarget, _Mapping]] = ...) -> None: ...

class HandoffTarget(_message.Message):
    __slots__ = ("worker_id", "address", "epoch", "kv_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    epoch: int
    kv_address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., kv_address: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "load", "last_heartbeat_unix_ns")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    load: _common_pb2.WorkerLoad
    last_heartbeat_unix_ns: int
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., last_heartbeat_unix_ns: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "degraded")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    degraded: bool
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., degraded: _Optional[bool] = ...) -> None: ...

class RouteSessionRequest(_message.Message):
    __slots__ = ("routes", "releases", "cancels")
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    routes: _containers.RepeatedCompositeFieldContainer[RouteTicket]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseRequest]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, routes: _Optional[_Iterable[_Union[RouteTicket, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseRequest, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ...) -> None: ...

class RouteTicket(_message.Message):
    __slots__ = ("ticket", "request", "traceparent")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    request: RouteRequest
    traceparent: str
    def __init__(self, ticket: _Optional[int] = ..., request: _Optional[_Union[RouteRequest, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class RouteSessionResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[RouteOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[RouteOutcome, _Mapping]]] = ...) -> None: ...

class RouteOutcome(_message.Message):
    __slots__ = ("ticket", "route", "error")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    route: RouteResponse
    error: _common_pb2.Error
    def __init__(self, ticket: _Optional[int] = ..., route: _Optional[_Union[RouteResponse, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
