"""Protobuf <-> domain conversions of the worker's edge (Session, load, info).

The only worker modules that build or read `*_pb2` messages are this one, the servicer
(service.py) and the session (session.py); the engine speaks SamplingParams,
RequestOutput and TokenLogprobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import orjson

from meshserve.proto.v1 import common_pb2, worker_pb2
from meshserve.services.worker.engine.images import PromptImage
from meshserve.services.worker.serving.request_stream import RequestTimes
from meshserve.shared.errors import InternalError, InvalidRequestError
from meshserve.shared.logprobs import TokenLogprobs
from meshserve.shared.sampling_params import WHOLE_VOCAB_WIRE, SamplingParams
from meshserve.shared.structured_outputs import StructuredKind, StructuredOutputs

FINISH_PB = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
             "abort": common_pb2.FINISH_REASON_ABORT}
"""FinishReason of each domain finish reason."""


def sampling_params_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """The domain SamplingParams a proto carries (unset optionals take their defaults)."""
    has = p.HasField
    return SamplingParams(
        n=p.n if has("n") else 1,
        temperature=p.temperature if has("temperature") else 1.0,
        top_p=p.top_p if has("top_p") else 1.0,
        top_k=p.top_k, min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if has("repetition_penalty") else 1.0,
        logit_bias=dict(p.logit_bias) or None,
        seed=p.seed if has("seed") else None,
        min_tokens=p.min_tokens,
        max_tokens=p.max_tokens if has("max_tokens") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
        logprobs=_logprobs_count(p.logprobs) if has("logprobs") else None,
        prompt_logprobs=_logprobs_count(p.prompt_logprobs) if has("prompt_logprobs") else None,
        skip_special_tokens=p.skip_special_tokens if has("skip_special_tokens") else True,
        spaces_between_special_tokens=(p.spaces_between_special_tokens
                                       if has("spaces_between_special_tokens") else True),
        structured=(_structured(p.structured) if has("structured") else None),
        bad_words=tuple(p.bad_words), allowed_token_ids=tuple(p.allowed_token_ids),
        use_beam_search=p.use_beam_search,
        length_penalty=p.length_penalty if has("length_penalty") else 1.0,
        early_stopping=_EARLY_STOPPING.get(p.early_stopping, False),
        extra=_extra(p.extra_json))


# The wire's BeamEarlyStopping as SamplingParams.early_stopping (UNSPECIFIED: False).
_EARLY_STOPPING: dict[int, bool | str] = {
    common_pb2.BEAM_EARLY_STOPPING_FIRST: True, common_pb2.BEAM_EARLY_STOPPING_NEVER: "never"}


def _structured(p: common_pb2.StructuredOutputs) -> StructuredOutputs:
    if p.kind == common_pb2.STRUCTURED_KIND_UNSPECIFIED:
        raise InvalidRequestError("structured_outputs.kind is unspecified",
                                  param="structured_outputs")
    name = common_pb2.StructuredKind.Name(p.kind).removeprefix("STRUCTURED_KIND_")
    return StructuredOutputs(StructuredKind[name], p.spec, not p.disable_any_whitespace)


def _extra(extra_json: str) -> dict[str, object]:
    if not extra_json:
        return {}
    try:
        extra = orjson.loads(extra_json)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"extra_json is not valid JSON: {exc}",
                                  param="extra_json") from None
    if not isinstance(extra, dict):
        raise InvalidRequestError("extra_json must be a JSON object", param="extra_json")
    return extra


def prompt_images(prompt: worker_pb2.Prompt) -> list[PromptImage]:
    """A prompt's images (their order and ranges are checked by the engine); a prompt
    given as embeddings is one run over all its tokens (engine/prompt_embeds.py)."""
    images = [PromptImage(image.data, image.hash, image.range.offset, image.range.length)
              for image in prompt.images]
    if prompt.HasField("embeds"):
        embeds = prompt.embeds
        images.insert(0, PromptImage(embeds.data, embeds.hash, 0, len(prompt.token_ids),
                                     dtype=embeds.dtype or "?"))
    return images


def request_images(prompts: Sequence[worker_pb2.Prompt]) -> list[list[PromptImage]]:
    """Each prompt's images (engine_thread's `images`): [] when no prompt has any."""
    if not any(p.images or p.HasField("embeds") for p in prompts):
        return []
    return [prompt_images(p) for p in prompts]


def resumed_sequences(resumed: Iterable[worker_pb2.ResumedSequence]) -> dict[int, list[int]]:
    """Sequence index -> the output tokens it brings from the worker it was lost on."""
    sequences: dict[int, list[int]] = {}
    for seq in resumed:
        if seq.index in sequences:
            raise InvalidRequestError(f"sequence {seq.index} is resumed twice",
                                      param="resumed")
        sequences[seq.index] = list(seq.token_ids)
    return sequences


def _logprobs_count(wire: int) -> int:
    """A wire logprobs count as SamplingParams holds it (-1: the whole vocabulary)."""
    return -1 if wire == WHOLE_VOCAB_WIRE else wire


def logprobs_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    """The wire form of one position's logprobs."""
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def prompt_logprobs_pb(entries: Sequence[TokenLogprobs | None]
                       ) -> Iterator[common_pb2.TokenLogprobs]:
    """Prompt logprobs from position 1 on: position 0 has none (nothing precedes it)."""
    for position, lp in enumerate(entries[1:], start=1):
        if lp is None:
            raise InternalError(f"the engine gave no logprob for prompt position {position}")
        yield logprobs_pb(lp)


def timings_pb(times: RequestTimes, now: float) -> common_pb2.Timings:
    """A request's Timings as of `now` (time.monotonic())."""
    queued, prefill, decode = times.durations_ns(now)
    return common_pb2.Timings(
        queued_ns=queued, prefill_ns=prefill, decode_ns=decode,
        step_forward_ns=times.step_forward_ns, num_steps=times.num_steps,
        num_preemptions=times.num_preemptions, sent_unix_ns=time.time_ns())
