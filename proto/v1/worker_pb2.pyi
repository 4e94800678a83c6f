from meshserve.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_id",)
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    lora_id: int
    def __init__(self, lora_id: _Optional[int] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "dimensions", "normalize", "deadline_unix_ns")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[Prompt]
    dimensions: int
    normalize: bool
    deadline_unix_ns: int
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ..., deadline_unix_ns: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("dimensions", "embeddings", "num_prompt_tokens", "queued_ns", "forward_ns")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    embeddings: bytes
    num_prompt_tokens: int
    queued_ns: int
    forward_ns: int
    def __init__(self, dimensions: _Optional[int] = ..., embeddings: _Optional[bytes] = ..., num_prompt_tokens: _Optional[int] = ..., queued_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("token_ids", "images", "embeds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    embeds: PromptEmbeds
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ..., embeds: _Optional[_Union[PromptEmbeds, _Mapping]] = ...) -> None: ...

class PromptEmbeds(_message.Message):
    __slots__ = ("data", "dtype", "hash")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    hash: bytes
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., hash: _Optional[bytes] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("data", "hash", "range")
    DATA_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    hash: bytes
    range: _common_pb2.PlaceholderRange
    def __init__(self, data: _Optional[bytes] = ..., hash: _Optional[bytes] = ..., range: _Optional[_Union[_common_pb2.PlaceholderRange, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "params", "priority", "cache_salt", "lora_id", "deadline_unix_ns", "kvstore_blocks", "prefill_only", "handed_off", "kv_source", "kv_target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    KVSTORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    params: _common_pb2.SamplingParams
    priority: int
    cache_salt: str
    lora_id: int
    deadline_unix_ns: int
    kvstore_blocks: int
    prefill_only: bool
    handed_off: bool
    kv_source: str
    kv_target: str
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_id: _Optional[int] = ..., deadline_unix_ns: _Optional[int] = ..., kvstore_blocks: _Optional[int] = ..., prefill_only: _Optional[bool] = ..., handed_off: _Optional[bool] = ..., kv_source: _Optional[str] = ..., kv_target: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _common_pb2.WorkerLoad
    def __init__(self, load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.WorkerInfo
    def __init__(self, info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("adds", "aborts")
    ADDS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    adds: _containers.RepeatedCompositeFieldContainer[SessionAdd]
    aborts: _containers.RepeatedCompositeFieldContainer[SessionAbort]
    def __init__(self, adds: _Optional[_Iterable[_Union[SessionAdd, _Mapping]]] = ..., aborts: _Optional[_Iterable[_Union[SessionAbort, _Mapping]]] = ...) -> None: ...

class SessionAdd(_message.Message):
    __slots__ = ("handle", "request", "traceparent", "tracestate", "resumed")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    handle: int
    request: GenerateRequest
    traceparent: str
    tracestate: str
    resumed: _containers.RepeatedCompositeFieldContainer[ResumedSequence]
    def __init__(self, handle: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ..., resumed: _Optional[_Iterable[_Union[ResumedSequence, _Mapping]]] = ...) -> None: ...

class ResumedSequence(_message.Message):
    __slots__ = ("index", "token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionAbort(_message.Message):
    __slots__ = ("handle", "indices")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handle: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("handles", "indices", "num_tokens", "token_ids", "finish_reasons", "details", "errors", "done", "num_steps", "step_forward_ns", "sent_unix_ns")
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    details: _containers.RepeatedCompositeFieldContainer[EntryDetail]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    done: _containers.RepeatedCompositeFieldContainer[RequestDone]
    num_steps: int
    step_forward_ns: int
    sent_unix_ns: int
    def __init__(self, handles: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., details: _Optional[_Iterable[_Union[EntryDetail, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., done: _Optional[_Iterable[_Union[RequestDone, _Mapping]]] = ..., num_steps: _Optional[int] = ..., step_forward_ns: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...

class EntryDetail(_message.Message):
    __slots__ = ("entry", "logprobs", "prompt_logprobs", "stop_token_id", "cached_tokens")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    entry: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    stop_token_id: int
    cached_tokens: int
    def __init__(self, entry: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., stop_token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("handle", "error")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    handle: int
    error: _common_pb2.Error
    def __init__(self, handle: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class RequestDone(_message.Message):
    __slots__ = ("handle", "timings", "handed_off", "kv_source", "refused")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    handle: int
    timings: _common_pb2.Timings
    handed_off: bool
    kv_source: str
    refused: bool
    def __init__(self, handle: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., handed_off: _Optional[bool] = ..., kv_source: _Optional[str] = ..., refused: _Optional[bool] = ...) -> None: ...
