from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BeamEarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BEAM_EARLY_STOPPING_UNSPECIFIED: _ClassVar[BeamEarlyStopping]
    BEAM_EARLY_STOPPING_HEURISTIC: _ClassVar[BeamEarlyStopping]
    BEAM_EARLY_STOPPING_FIRST: _ClassVar[BeamEarlyStopping]
    BEAM_EARLY_STOPPING_NEVER: _ClassVar[BeamEarlyStopping]

class StructuredKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRUCTURED_KIND_UNSPECIFIED: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON_OBJECT: _ClassVar[StructuredKind]
    STRUCTURED_KIND_REGEX: _ClassVar[StructuredKind]
    STRUCTURED_KIND_CHOICE: _ClassVar[StructuredKind]
    STRUCTURED_KIND_GRAMMAR: _ClassVar[StructuredKind]
    STRUCTURED_KIND_STRUCTURAL_TAG: _ClassVar[StructuredKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_MIXED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class Runner(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUNNER_UNSPECIFIED: _ClassVar[Runner]
    RUNNER_GENERATE: _ClassVar[Runner]
    RUNNER_POOLING: _ClassVar[Runner]
BEAM_EARLY_STOPPING_UNSPECIFIED: BeamEarlyStopping
BEAM_EARLY_STOPPING_HEURISTIC: BeamEarlyStopping
BEAM_EARLY_STOPPING_FIRST: BeamEarlyStopping
BEAM_EARLY_STOPPING_NEVER: BeamEarlyStopping
STRUCTURED_KIND_UNSPECIFIED: StructuredKind
STRUCTURED_KIND_JSON: StructuredKind
STRUCTURED_KIND_JSON_OBJECT: StructuredKind
STRUCTURED_KIND_REGEX: StructuredKind
STRUCTURED_KIND_CHOICE: StructuredKind
STRUCTURED_KIND_GRAMMAR: StructuredKind
STRUCTURED_KIND_STRUCTURAL_TAG: StructuredKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_MIXED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
RUNNER_UNSPECIFIED: Runner
RUNNER_GENERATE: Runner
RUNNER_POOLING: Runner

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "min_tokens", "max_tokens", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "extra_json", "structured", "bad_words", "allowed_token_ids", "use_beam_search", "length_penalty", "early_stopping")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    seed: int
    min_tokens: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    extra_json: str
    structured: StructuredOutputs
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    use_beam_search: bool
    length_penalty: float
    early_stopping: BeamEarlyStopping
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., extra_json: _Optional[str] = ..., structured: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., bad_words: _Optional[_Iterable[str]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., use_beam_search: _Optional[bool] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[BeamEarlyStopping, str]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("kind", "spec", "disable_any_whitespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredKind
    spec: str
    disable_any_whitespace: bool
    def __init__(self, kind: _Optional[_Union[StructuredKind, str]] = ..., spec: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_ns", "prefill_ns", "decode_ns", "kv_fetch_ns", "step_forward_ns", "num_steps", "num_preemptions", "sent_unix_ns")
    QUEUED_NS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    queued_ns: int
    prefill_ns: int
    decode_ns: int
    kv_fetch_ns: int
    step_forward_ns: int
    num_steps: int
    num_preemptions: int
    sent_unix_ns: int
    def __init__(self, queued_ns: _Optional[int] = ..., prefill_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., kv_fetch_ns: _Optional[int] = ..., step_forward_ns: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "epoch", "num_running", "num_waiting", "num_pending_prefill_tokens", "num_used_blocks", "num_free_blocks", "num_total_blocks", "max_running", "draining", "snapshot_unix_ns", "num_active_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    num_running: int
    num_waiting: int
    num_pending_prefill_tokens: int
    num_used_blocks: int
    num_free_blocks: int
    num_total_blocks: int
    max_running: int
    draining: bool
    snapshot_unix_ns: int
    num_active_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_pending_prefill_tokens: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., max_running: _Optional[int] = ..., draining: _Optional[bool] = ..., snapshot_unix_ns: _Optional[int] = ..., num_active_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "epoch", "address", "model_names", "block_size", "max_model_len", "num_total_blocks", "lora_ids", "tensor_parallel_size", "kv_namespace", "sampling_defaults_json", "runner", "embedding_size", "metrics_url", "loras", "class_labels", "role", "kv_handoff_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_DEFAULTS_JSON_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SIZE_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    CLASS_LABELS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    address: str
    model_names: _containers.RepeatedScalarFieldContainer[str]
    block_size: int
    max_model_len: int
    num_total_blocks: int
    lora_ids: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel_size: int
    kv_namespace: str
    sampling_defaults_json: str
    runner: Runner
    embedding_size: int
    metrics_url: str
    loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    class_labels: _containers.RepeatedScalarFieldContainer[str]
    role: WorkerRole
    kv_handoff_address: str
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., address: _Optional[str] = ..., model_names: _Optional[_Iterable[str]] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., lora_ids: _Optional[_Iterable[int]] = ..., tensor_parallel_size: _Optional[int] = ..., kv_namespace: _Optional[str] = ..., sampling_defaults_json: _Optional[str] = ..., runner: _Optional[_Union[Runner, str]] = ..., embedding_size: _Optional[int] = ..., metrics_url: _Optional[str] = ..., loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., class_labels: _Optional[_Iterable[str]] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., kv_handoff_address: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "id", "base_model_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    base_model_name: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("kind", "message", "param", "retry_after_s", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    param: str
    retry_after_s: int
    reason: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ..., retry_after_s: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...
