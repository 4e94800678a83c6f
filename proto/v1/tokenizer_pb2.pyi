from meshserve.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "content_parts_json", "name", "tool_call_id", "tool_calls_json", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_JSON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    content_parts_json: str
    name: str
    tool_call_id: str
    tool_calls_json: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., content_parts_json: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "tools_json", "add_generation_prompt", "add_special_tokens", "continue_final_message", "chat_template", "chat_template_kwargs_json", "truncate_prompt_tokens", "return_token_strs", "suffix", "images")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: ChatMessages
    tools_json: str
    add_generation_prompt: bool
    add_special_tokens: bool
    continue_final_message: bool
    chat_template: str
    chat_template_kwargs_json: str
    truncate_prompt_tokens: int
    return_token_strs: bool
    suffix: str
    images: _containers.RepeatedCompositeFieldContainer[ImageSize]
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., tools_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs_json: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ..., return_token_strs: _Optional[bool] = ..., suffix: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageSize, _Mapping]]] = ...) -> None: ...

class ImageSize(_message.Message):
    __slots__ = ("width", "height")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "prompt_text", "max_model_len", "token_strs", "image_ranges")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_RANGES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    image_ranges: _containers.RepeatedCompositeFieldContainer[_common_pb2.PlaceholderRange]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ..., image_ranges: _Optional[_Iterable[_Union[_common_pb2.PlaceholderRange, _Mapping]]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: TokenizeRequest
    def __init__(self, prompt: _Optional[_Union[TokenizeRequest, _Mapping]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("count", "max_model_len")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    count: int
    max_model_len: int
    def __init__(self, count: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class TokenizerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class TokenizerInfoResponse(_message.Message):
    __slots__ = ("info_json",)
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    info_json: str
    def __init__(self, info_json: _Optional[str] = ...) -> None: ...

class DetokenizeOptions(_message.Message):
    __slots__ = ("model", "request_id", "num_sequences", "prompt_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "stop", "include_stop_str_in_output", "min_tokens", "check_vocabulary")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECK_VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    num_sequences: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    min_tokens: int
    check_vocabulary: bool
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., num_sequences: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., check_vocabulary: _Optional[bool] = ...) -> None: ...

class DetokenizeOpen(_message.Message):
    __slots__ = ("handle", "options", "prompt_tails", "samples_per_prompt", "traceparent", "resumed")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAILS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    handle: int
    options: DetokenizeOptions
    prompt_tails: _containers.RepeatedCompositeFieldContainer[TokenIds]
    samples_per_prompt: int
    traceparent: str
    resumed: _containers.RepeatedCompositeFieldContainer[DetokenizeResume]
    def __init__(self, handle: _Optional[int] = ..., options: _Optional[_Union[DetokenizeOptions, _Mapping]] = ..., prompt_tails: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., samples_per_prompt: _Optional[int] = ..., traceparent: _Optional[str] = ..., resumed: _Optional[_Iterable[_Union[DetokenizeResume, _Mapping]]] = ...) -> None: ...

class DetokenizeResume(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finished", "entry_sizes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ENTRY_SIZES_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    entry_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., entry_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeSessionRequest(_message.Message):
    __slots__ = ("opens", "handles", "indices", "num_tokens", "token_ids", "finals", "stopped_on_tokens", "lookup_token_ids", "closes")
    OPENS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINALS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_ON_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CLOSES_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[DetokenizeOpen]
    handles: _containers.RepeatedScalarFieldContainer[int]
    indices: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finals: _containers.RepeatedScalarFieldContainer[bool]
    stopped_on_tokens: _containers.RepeatedScalarFieldContainer[bool]
    lookup_token_ids: _containers.RepeatedScalarFieldContainer[int]
    closes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, opens: _Optional[_Iterable[_Union[DetokenizeOpen, _Mapping]]] = ..., handles: _Optional[_Iterable[int]] = ..., indices: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finals: _Optional[_Iterable[bool]] = ..., stopped_on_tokens: _Optional[_Iterable[bool]] = ..., lookup_token_ids: _Optional[_Iterable[int]] = ..., closes: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeSessionResponse(_message.Message):
    __slots__ = ("texts", "stopped", "finished", "num_output_tokens", "stop_strings", "token_bytes", "errors")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    stopped: _containers.RepeatedScalarFieldContainer[bool]
    finished: _containers.RepeatedScalarFieldContainer[bool]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    errors: _containers.RepeatedCompositeFieldContainer[HandleError]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., stopped: _Optional[_Iterable[bool]] = ..., finished: _Optional[_Iterable[bool]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., token_bytes: _Optional[_Iterable[bytes]] = ..., errors: _Optional[_Iterable[_Union[HandleError, _Mapping]]] = ...) -> None: ...

class HandleError(_message.Message):
    __slots__ = ("handle", "error")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    handle: int
    error: _common_pb2.Error
    def __init__(self, handle: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
