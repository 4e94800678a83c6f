"""Protobuf <-> domain conversions at the gateway's edge (the only gateway module that
builds request messages from domain objects; the rest speaks SamplingParams, dicts and
TokenLogprobs).

Values the HTTP API accepts but a protobuf field cannot hold (a token id past uint32, a
top_k past int32) become InvalidRequestError naming the parameter, never a 500.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import orjson

from meshserve.proto.v1 import common_pb2, scheduler_pb2, tokenizer_pb2, worker_pb2
from meshserve.services.gateway.flow.job import PlacedImage, PreparedPrompt
from meshserve.services.gateway.media.loader import LoadedImage
from meshserve.shared.errors import InternalError, InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import WHOLE_VOCAB_WIRE, SamplingParams
from meshserve.shared.structured_outputs import StructuredOutputs

_UINT32_MAX = 2**32 - 1
_INT32 = (-(2**31), 2**31 - 1)
_T = TypeVar("_T")

FINISH_REASONS: Mapping[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
"""OpenAI finish_reason of each FinishReason but UNSPECIFIED ("abort" as vLLM reports it)."""


def check_token_ids(token_ids: Sequence[int], param: str) -> list[int]:
    """Token ids as a list, each within uint32 (the wire type)."""
    ids = list(token_ids)
    if any(t > _UINT32_MAX for t in ids):
        raise InvalidRequestError(f"'{param}' holds a token id larger than {_UINT32_MAX}",
                                  param=param)
    return ids


def _in_int32(value: int, param: str) -> int:
    if not _INT32[0] <= value <= _INT32[1]:
        raise InvalidRequestError(f"'{param}' must fit in 32 bits, got {value}", param=param)
    return value


# SamplingParams.early_stopping (transformers' values) on the wire.
_EARLY_STOPPING: dict[bool | str, common_pb2.BeamEarlyStopping] = {
    False: common_pb2.BEAM_EARLY_STOPPING_HEURISTIC, True: common_pb2.BEAM_EARLY_STOPPING_FIRST,
    "never": common_pb2.BEAM_EARLY_STOPPING_NEVER}


def sampling_params(params: SamplingParams, max_tokens: int | None) -> common_pb2.SamplingParams:
    """The wire form of `params`, with `max_tokens` resolved by the gateway (None: unset)."""
    seed = params.seed
    if seed is not None and seed >= 2**63:
        seed -= 2**64  # the proto's int64 carries [2**63, 2**64) as two's complement
    message = common_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p,
        top_k=_in_int32(params.top_k, "top_k"), min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, seed=seed,
        min_tokens=_in_int32(params.min_tokens, "min_tokens"), max_tokens=max_tokens,
        stop=list(params.stop), bad_words=list(params.bad_words),
        allowed_token_ids=check_token_ids(params.allowed_token_ids, "allowed_token_ids"),
        stop_token_ids=check_token_ids(params.stop_token_ids, "stop_token_ids"),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos, logprobs=_logprobs_wire(params.logprobs),
        prompt_logprobs=_logprobs_wire(params.prompt_logprobs),
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        extra_json=orjson.dumps(params.extra).decode() if params.extra else "",
        use_beam_search=params.use_beam_search, length_penalty=params.length_penalty,
        early_stopping=_EARLY_STOPPING[params.early_stopping])
    if params.structured is not None:
        message.structured.CopyFrom(structured_outputs(params.structured))
    if params.logit_bias:
        check_token_ids(list(params.logit_bias), "logit_bias")
        message.logit_bias.update(params.logit_bias)
    return message


def structured_outputs(value: StructuredOutputs) -> common_pb2.StructuredOutputs:
    return common_pb2.StructuredOutputs(
        kind=common_pb2.StructuredKind.Value(f"STRUCTURED_KIND_{value.kind.name}"),
        spec=value.spec, disable_any_whitespace=not value.any_whitespace)


def _json_text(value: Any) -> str:
    return "" if value is None else orjson.dumps(value).decode()


def _typed(message: Mapping[str, Any], key: str, kind: type[_T] | tuple[type, ...],
           where: str) -> Any:
    value = message.get(key)
    if value is not None and not isinstance(value, kind):
        raise InvalidRequestError(f"'{where}.{key}' has the wrong type "
                                  f"({type(value).__name__})", param="messages")
    return value


def chat_message(message: Mapping[str, Any], index: int) -> tokenizer_pb2.ChatMessage:
    """One OpenAI chat message as the tokenizer takes it (deep checks are the tokenizer's)."""
    where = f"messages[{index}]"
    role = _typed(message, "role", str, where)
    if not role:
        raise InvalidRequestError(f"'{where}.role' is required", param="messages")
    content = _typed(message, "content", (str, list), where)
    result = tokenizer_pb2.ChatMessage(
        role=role, name=_typed(message, "name", str, where) or "",
        tool_call_id=_typed(message, "tool_call_id", str, where) or "",
        tool_calls_json=_json_text(_typed(message, "tool_calls", list, where)),
        reasoning_content=_typed(message, "reasoning_content", str, where) or "")
    if isinstance(content, list):
        result.content_parts_json = _json_text(content)
    elif content is not None:
        result.content = content
    return result


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> tokenizer_pb2.ChatMessages:
    """The conversation of a chat request."""
    return tokenizer_pb2.ChatMessages(messages=[chat_message(m, i)
                                                for i, m in enumerate(messages)])


def image_sizes(images: Sequence[LoadedImage]) -> list[tokenizer_pb2.ImageSize]:
    """TokenizeRequest.images: each image's pixel size, in conversation order."""
    return [tokenizer_pb2.ImageSize(width=image.width, height=image.height) for image in images]


def check_image_ranges(response: tokenizer_pb2.TokenizeResponse, num_images: int) -> None:
    """InternalError unless the tokenizer placed each image sent, inside the prompt."""
    ranges, size = response.image_ranges, len(response.token_ids)
    if len(ranges) != num_images:
        raise InternalError(
            f"the tokenizer answered {len(ranges)} image range(s) for the {num_images} "
            "image(s) sent (TokenizeResponse.image_ranges); is it older than the gateway?")
    for k, placed in enumerate(ranges):
        if placed.length == 0 or placed.offset + placed.length > size:
            raise InternalError(f"the tokenizer placed image {k} at tokens [{placed.offset}, "
                                f"{placed.offset + placed.length}) of a {size}-token prompt")


def prompt_images(images: Sequence[LoadedImage], response: tokenizer_pb2.TokenizeResponse
                  ) -> tuple[PlacedImage, ...]:
    """Each image with the placeholder run the tokenizer gave it (check_image_ranges first)."""
    return tuple(PlacedImage(image, placed.offset, placed.length)
                 for image, placed in zip(images, response.image_ranges, strict=True))


def prompt(prepared: PreparedPrompt) -> worker_pb2.Prompt:
    """A worker's Prompt: token ids, and each image's file, SHA-256 and placeholder run, or
    the rows of a prompt given as embeddings."""
    message = worker_pb2.Prompt(token_ids=prepared.token_ids, images=[
        worker_pb2.ImageInput(data=placed.image.data, hash=placed.image.sha256,
                              range=common_pb2.PlaceholderRange(offset=placed.offset,
                                                                length=placed.length))
        for placed in prepared.images])
    embeds = prepared.embeds
    if embeds is not None:
        message.embeds.CopyFrom(worker_pb2.PromptEmbeds(data=embeds.data, dtype=embeds.dtype,
                                                        hash=embeds.digest))
    return message


def route_images(prepared: PreparedPrompt) -> list[scheduler_pb2.RouteImage]:
    """A prompt's images as the scheduler hashes them into the prompt's blocks (embeddings
    as one run over the whole prompt, as the worker hashes them)."""
    images = [scheduler_pb2.RouteImage(hash=placed.image.sha256,
                                       range=common_pb2.PlaceholderRange(
                                           offset=placed.offset, length=placed.length))
              for placed in prepared.images]
    if prepared.embeds is not None:
        images.insert(0, scheduler_pb2.RouteImage(
            hash=prepared.embeds.digest,
            range=common_pb2.PlaceholderRange(offset=0, length=len(prepared.token_ids))))
    return images


def _logprobs_wire(count: int | None) -> int | None:
    """A logprobs count as the wire's uint32 carries it (-1, every token: WHOLE_VOCAB_WIRE)."""
    return WHOLE_VOCAB_WIRE if count == -1 else count


def token_logprobs(entry: common_pb2.TokenLogprobs) -> TokenLogprobs:
    """A worker's TokenLogprobs as the domain type."""
    return TokenLogprobs(entry.token_id, entry.logprob, entry.rank,
                         list(zip(entry.top_token_ids, entry.top_logprobs, strict=True)))


def lookup_ids(entries: Sequence[common_pb2.TokenLogprobs]) -> list[int]:
    """Tokens whose text logprobs show: each chosen token, then its alternatives."""
    ids: list[int] = []
    for entry in entries:
        ids.append(entry.token_id)
        ids.extend(entry.top_token_ids)
    return ids


def guarded(build: Callable[[], _T], param: str) -> _T:
    """Run a message builder, turning protobuf's range errors into InvalidRequestError."""
    try:
        return build()
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"'{param}' has a value out of range: {exc}",
                                  param=param) from exc
