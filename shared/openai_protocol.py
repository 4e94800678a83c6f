"""The OpenAI HTTP API at the edge: request bodies in (the bodies sent back are built by
`meshserve.shared.openai_bodies`).

Parsing turns a decoded JSON body of `/v1/completions` or
`/v1/chat/completions` into a frozen request object holding validated
`SamplingParams`; a wrong type or value raises `InvalidRequestError` naming
the parameter. A field of the OpenAI or vLLM schemas that meshserve does not
implement is refused with a 400 naming it (`UNSUPPORTED_FIELDS`), never silently
ignored; keys outside both schemas are ignored (clients send extras), and a known key
with a wrong type is always an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.structured_outputs import StructuredOutputs
from meshserve.shared.structured_request import structured_outputs_of
from meshserve.shared.tool_choice import ToolChoice, read_tool_choice

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
_SAMPLING_INTS = ("n", "top_k", "seed", "min_tokens", "prompt_logprobs")
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "length_penalty")
_SAMPLING_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                   "spaces_between_special_tokens", "use_beam_search")

# Strings pydantic's lax mode (vLLM's request models) reads as booleans.
_LAX_BOOLS = {**dict.fromkeys(("true", "t", "yes", "y", "on", "1"), True),
              **dict.fromkeys(("false", "f", "no", "n", "off", "0"), False)}


# -- fields meshserve does not implement -----------------------------------------------------

# Fields of the OpenAI and vLLM request schemas that meshserve does not implement: each
# is refused with a 400 naming it, unless its value is absent, null or one of the values
# listed (those that ask for nothing, such as vLLM's defaults). Nothing is silently ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "logits_processors": ((), "logits processors are not supported"),
    "vllm_xargs": (({},), "vllm_xargs is not supported"),
    "kv_transfer_params": ((), "KV transfer parameters are not supported"),
    "mm_processor_kwargs": ((), "multimodal inputs are not supported"),
    "request_id": ((), "a request id in the body is not supported"),
}
_UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "documents": ((), "documents are not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "functions": ((), "'functions' is not supported; tools reach the chat template"),
    "function_call": ((), "'function_call' is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "stored completions are not supported"),
    "metadata": (({},), ("metadata is kept only with stored completions, which are not "
                        "supported")),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
    "verbosity": ((), "verbosity is not supported"),
    "moderation": ((), "moderation is not supported"),
    "prompt_cache_key": ((), ("prompt cache keys are not supported (prefix caching is "
                             "automatic)")),
    "prompt_cache_options": ((), "prompt cache options are not supported"),
    "prompt_cache_retention": ((), "prompt cache retention is not supported"),
}
UNSUPPORTED_CHAT_FIELDS = {**UNSUPPORTED_FIELDS, **_UNSUPPORTED_CHAT_FIELDS}
UNSUPPORTED_COMPLETION_FIELDS = UNSUPPORTED_FIELDS


def _refuse_unsupported(body: Mapping[str, Any],
                        table: Mapping[str, tuple[tuple[object, ...], str]]) -> None:
    """InvalidRequestError naming the first field of `table` asking for something."""
    for name, (harmless, reason) in table.items():
        value = body.get(name)
        if value is None or any(value == ok and type(value) is type(ok) for ok in harmless):
            continue
        raise _bad(f"'{name}' is not supported: {reason}", name)


# -- reading a body -------------------------------------------------------------------------

def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


class _Fields:
    """Typed reads of a JSON object; null and absent both read as None."""

    def __init__(self, body: object, prefix: str = "") -> None:
        if not isinstance(body, Mapping):
            raise _bad("request body must be a JSON object", "body")
        self.body = body
        self.prefix = prefix  # names nested keys in errors, e.g. "stream_options."

    def _wrong(self, key: str, what: str, value: object) -> InvalidRequestError:
        name, shown = self.prefix + key, repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return _bad(f"'{name}' must be {what}, got {shown}", name)

    def raw(self, key: str) -> Any:
        return self.body.get(key)

    def int_(self, key: str) -> int | None:
        value = self.body.get(key)
        # orjson reads integers outside 64 bits as floats: those stay refused (not rounded).
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self._wrong(key, "an integer", value)
        return value

    def float_(self, key: str) -> float | None:
        value = self.body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise self._wrong(key, "a number", value)
        return None if value is None else float(value)

    def bool_(self, key: str) -> bool | None:
        value = self.body.get(key)
        if value is not None and not isinstance(value, bool):
            raise self._wrong(key, "a boolean", value)
        return value

    def lax_bool(self, key: str) -> bool | None:
        """A boolean as vLLM's pydantic models read one: also "true"/"false", "yes"/"no",
        "on"/"off", "1"/"0" (any case) and the numbers 1 and 0."""
        value = self.body.get(key)
        if isinstance(value, str) and value.lower() in _LAX_BOOLS:
            return _LAX_BOOLS[value.lower()]
        if not isinstance(value, bool) and isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        return self.bool_(key)

    def str_(self, key: str) -> str | None:
        value = self.body.get(key)
        if value is not None and not isinstance(value, str):
            raise self._wrong(key, "a string", value)
        return value

    def obj(self, key: str) -> dict[str, Any] | None:
        value = self.body.get(key)
        if value is not None and not isinstance(value, dict):
            raise self._wrong(key, "an object", value)
        return value

    def list_(self, key: str) -> list[Any] | None:
        value = self.body.get(key)
        if value is not None and not isinstance(value, list):
            raise self._wrong(key, "an array", value)
        return value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _stop_strings(fields: _Fields) -> tuple[str, ...]:
    value = fields.raw("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _bad("'stop' must be a string or an array of strings", "stop")


def _logit_bias(fields: _Fields) -> dict[int, float] | None:
    value = fields.obj("logit_bias")
    if value is None:
        return None
    bias: dict[int, float] = {}
    for key, weight in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise _bad(f"'logit_bias' values must be numbers, got {weight!r}", "logit_bias")
        bias[token] = float(weight)
    return bias


def _sampling_kwargs(fields: _Fields) -> dict[str, Any]:
    """SamplingParams fields common to both endpoints, only those the body sets."""
    kwargs: dict[str, Any] = {}
    for key in _SAMPLING_INTS:
        kwargs[key] = fields.int_(key)
    for key in _SAMPLING_FLOATS:
        kwargs[key] = fields.float_(key)
    for key in _SAMPLING_BOOLS:
        kwargs[key] = fields.bool_(key)
    stop_ids = fields.list_("stop_token_ids")
    if stop_ids is not None:
        if not all(_is_token_id(t) for t in stop_ids):
            raise _bad("'stop_token_ids' must be an array of token ids", "stop_token_ids")
        kwargs["stop_token_ids"] = tuple(stop_ids)
    kwargs["stop"] = _stop_strings(fields)
    kwargs["logit_bias"] = _logit_bias(fields)
    kwargs["structured"] = structured_outputs_of(fields.body)
    bad_words = fields.list_("bad_words")
    if bad_words:
        if not all(isinstance(w, str) and w.strip() for w in bad_words):
            raise _bad("'bad_words' must be an array of non-empty strings", "bad_words")
        kwargs["bad_words"] = tuple(bad_words)
    allowed = fields.list_("allowed_token_ids")
    if allowed:
        if not all(_is_token_id(t) for t in allowed):
            raise _bad("'allowed_token_ids' must be an array of token ids", "allowed_token_ids")
        kwargs["allowed_token_ids"] = tuple(allowed)
    kwargs["early_stopping"] = _early_stopping(fields)
    best_of = fields.int_("best_of")
    if best_of is not None and best_of != (kwargs["n"] or 1):
        raise _bad(f"best_of ({best_of}) must equal n ({kwargs['n'] or 1}); "
                   "best_of > n is not supported", "best_of")
    return {key: value for key, value in kwargs.items() if value is not None}


def _early_stopping(fields: _Fields) -> bool | str | None:
    """Beam search's early_stopping: a boolean or "never" (transformers' values)."""
    if fields.raw("early_stopping") == "never":
        return "never"
    try:
        return fields.bool_("early_stopping")
    except InvalidRequestError:
        raise _bad("'early_stopping' must be true, false or \"never\", got "
                   f"{fields.raw('early_stopping')!r}", "early_stopping") from None


def _make_params(kwargs: dict[str, Any], aliases: Mapping[str, str]) -> SamplingParams:
    """SamplingParams(**kwargs), reporting errors under the request's own key names."""
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as exc:
        param = aliases.get(exc.param or "", exc.param)
        message = exc.message if param == exc.param else exc.message.replace(
            exc.param or "", param or "", 1)
        raise InvalidRequestError(message, param=param) from exc


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings that are not sampling parameters."""

    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """Keep only the prompt's last N tokens (vLLM's field); -1: the model's context length."""
    return_prompt_logprobs: bool = False
    """The body asked for `prompt_logprobs`: each choice carries them (vLLM's shape)."""
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    """Choices carry their `token_ids` and the prompt's `prompt_token_ids` (vLLM's field)."""
    """Logprobs name tokens as `token_id:<id>` instead of their text (vLLM's field)."""


def _options(fields: _Fields) -> RequestOptions:
    stream = bool(fields.bool_("stream"))
    stream_options = fields.obj("stream_options")
    if stream_options is not None and not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    opts = _Fields(stream_options or {}, prefix="stream_options.")
    cache_salt = fields.str_("cache_salt")
    if cache_salt == "":
        raise _bad("'cache_salt' must not be empty", "cache_salt")
    return RequestOptions(
        model=fields.str_("model"), stream=stream,
        include_usage=bool(opts.bool_("include_usage")),
        continuous_usage_stats=bool(opts.bool_("continuous_usage_stats")),
        priority=fields.int_("priority") or 0, cache_salt=cache_salt,
        user=fields.str_("user") or fields.str_("safety_identifier"),
        truncate_prompt_tokens=_truncate(fields),
        return_prompt_logprobs=_prompt_logprobs(fields, stream),
        return_tokens_as_token_ids=bool(fields.bool_("return_tokens_as_token_ids")),
        return_token_ids=bool(fields.bool_("return_token_ids")))


class TokenIdNames:
    """A TokenRenderer naming each token `token_id:<id>` (return_tokens_as_token_ids)."""

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_text(token_id).encode()


def _prompt_logprobs(fields: _Fields, stream: bool) -> bool:
    wanted = fields.int_("prompt_logprobs")
    if wanted is None:
        return False
    if wanted < -1:
        raise _bad(f"'prompt_logprobs' must be a positive value or -1 (the whole "
                   f"vocabulary), got {wanted}", "prompt_logprobs")
    if stream:
        raise _bad("'prompt_logprobs' is returned with whole responses only, not when "
                   "streaming", "prompt_logprobs")
    return True


def _truncate(fields: _Fields) -> int | None:
    keep = fields.int_("truncate_prompt_tokens")
    if keep is not None and keep < 1 and keep != -1:
        raise _bad("'truncate_prompt_tokens' must be a positive number of tokens, or -1 for "
                   f"the model's context length; got {keep}", "truncate_prompt_tokens")
    return keep


# -- /v1/completions ------------------------------------------------------------------------

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/completions body. `prompts` has one entry per batched prompt."""

    prompts: tuple[Prompt, ...]
    params: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    """Fill-in-the-middle: the text after the completion (the tokenizer builds the prompt)."""
    prompt_embeds: tuple[str, ...] = ()
    """Base64 `torch.save` files of prompts given as embeddings (shared/prompt_embeds.py),
    run before the text prompts (vLLM's order)."""


def _prompts(value: object) -> tuple[Prompt, ...]:
    if isinstance(value, str):
        return (value,)
    if value == [] or (isinstance(value, list) and [] in value):  # vLLM's text
        raise _bad("The decoder prompt cannot be empty", "prompt")
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return tuple(value)
        if all(_is_token_id(t) for t in value):
            return (tuple(value),)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return tuple(tuple(p) for p in value)
    raise _bad("'prompt' must be a string, an array of strings, an array of token ids or an "
               "array of arrays of token ids (none empty)", "prompt")


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a /v1/completions body."""
    fields = _Fields(body)
    _refuse_unsupported(fields.body, UNSUPPORTED_COMPLETION_FIELDS)
    embeds = _prompt_embeds(fields)
    if embeds is None and "prompt" not in fields.body:
        raise _bad("'prompt' is required", "prompt")
    prompt = fields.raw("prompt")
    prompts = () if embeds is not None and prompt in (None, "") else _prompts(prompt)
    if not prompts and not embeds:
        raise _bad("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    suffix = fields.str_("suffix")
    if suffix is not None and (embeds or not all(isinstance(p, str) for p in prompts)):
        raise _bad("'suffix' needs text prompts (not token ids or embeddings)", "suffix")
    kwargs = _sampling_kwargs(fields)
    max_tokens = fields.int_("max_tokens")
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = fields.int_("logprobs")
    echo = bool(fields.bool_("echo"))
    if echo and kwargs["logprobs"] is not None and "prompt_logprobs" not in kwargs:
        kwargs["prompt_logprobs"] = kwargs["logprobs"]  # echoed tokens carry logprobs too
    if embeds is not None and echo:
        raise _bad("Echo is unsupported with prompt embeds.", "echo")
    if embeds is not None and "prompt_logprobs" in kwargs:
        raise _bad("prompt_logprobs is not compatible with prompt embeds.", "prompt_logprobs")
    params = _make_params(kwargs, {})
    add_special = fields.bool_("add_special_tokens")
    return CompletionRequest(prompts, params, _options(fields), echo,
                             True if add_special is None else add_special, suffix,
                             embeds or ())


def _prompt_embeds(fields: _Fields) -> tuple[str, ...] | None:
    """The body's prompt_embeds: one base64 string or a list of them (None: not given)."""
    value = fields.raw("prompt_embeds")
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise _bad("'prompt_embeds' must be a base64 string of a torch.save'd tensor, or an "
               "array of them", "prompt_embeds")


# -- /v1/chat/completions -------------------------------------------------------------------

@dataclass(frozen=True)
class ChatCompletionRequest:
    """A validated /v1/chat/completions body.

    Messages are checked in depth (roles, content parts) where the chat
    template is applied: `Tokenizer.render_chat`.
    """

    messages: tuple[dict[str, Any], ...]
    params: SamplingParams
    options: RequestOptions = field(default_factory=RequestOptions)
    tools: tuple[dict[str, Any], ...] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    chat_template: str | None = None
    """A Jinja chat template for this request instead of the model's (vLLM's field)."""
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    echo: bool = False
    """vLLM's field: the answer starts with the final message's content when that message
    has the answer's role (with `continue_final_message`)."""

    @property
    def response_role(self) -> str:
        """The answer's role, as vLLM gives it: the assistant's after a generation prompt,
        else the final message's."""
        return "assistant" if self.add_generation_prompt else str(self.messages[-1]["role"])

    @property
    def echo_text(self) -> str:
        """What `echo` puts before the answer ("" without echo)."""
        last = self.messages[-1]
        if not self.echo or last.get("role") != self.response_role:
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)


def _tools(fields: _Fields) -> tuple[dict[str, Any], ...] | None:
    tools = fields.list_("tools")
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                       "tools")
    return tuple(tools) if tools else None


def _with_tool_constraint(params: SamplingParams, constraint: StructuredOutputs | None,
                          body: Mapping[str, Any]) -> SamplingParams:
    """`params` constrained to the JSON a required or named tool choice calls for. As in
    vLLM, the tool schema wins over a `response_format`, while `structured_outputs` (or a
    guided_* field) with a forced call is refused."""
    if constraint is None:
        return params
    if params.structured is not None and (
            body.get("response_format") is None or body.get("structured_outputs") is not None):
        raise _bad("You can only either use constraints for structured outputs or tools, "
                   "not both.", "tool_choice")
    return replace(params, structured=constraint)


def _chat_sampling(fields: _Fields) -> SamplingParams:
    kwargs = _sampling_kwargs(fields)
    aliases: dict[str, str] = {}
    max_tokens = fields.int_("max_completion_tokens")
    if max_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    else:
        max_tokens = fields.int_("max_tokens")
    kwargs["max_tokens"] = max_tokens  # None: as many as the context leaves
    top = fields.int_("top_logprobs")
    if fields.lax_bool("logprobs"):
        kwargs["logprobs"] = top or 0
        aliases["logprobs"] = "top_logprobs"
    elif top is not None:
        raise _bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return _make_params(kwargs, aliases)


def parse_chat_request(body: object) -> ChatCompletionRequest:
    """Validate a /v1/chat/completions body."""
    fields = _Fields(body)
    _refuse_unsupported(fields.body, UNSUPPORTED_CHAT_FIELDS)
    messages = fields.list_("messages")
    if not messages or not all(isinstance(m, dict) for m in messages):
        raise _bad("'messages' must be a non-empty array of message objects", "messages")
    params = _chat_sampling(fields)
    add_generation_prompt = fields.bool_("add_generation_prompt")
    continue_final = bool(fields.bool_("continue_final_message"))
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final
    if add_generation_prompt and continue_final:
        raise _bad("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                   "continue_final_message")
    add_special = fields.bool_("add_special_tokens")
    tools = _tools(fields)
    choice = read_tool_choice(fields.raw("tool_choice"), tools)
    parallel = fields.bool_("parallel_tool_calls") is not False
    params = _with_tool_constraint(params, choice.constraint(tools or (), parallel=parallel),
                                   fields.body)
    include_reasoning = fields.bool_("include_reasoning") is not False
    return ChatCompletionRequest(
        tuple(messages), params, _options(fields), tools, add_generation_prompt,
        continue_final, fields.obj("chat_template_kwargs"), bool(add_special),
        fields.str_("chat_template"), choice, parallel, include_reasoning,
        bool(fields.bool_("echo")))
