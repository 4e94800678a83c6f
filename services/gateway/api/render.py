"""Generation updates -> OpenAI response bodies: SSE chunks or one aggregated object.

One SSE event per choice per worker message (what OpenAI clients expect), all events
of one message written together; a choice with nothing new is left out of a message.
`/v1/completions` and `/v1/chat/completions` differ only in how a choice is shaped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshserve.services.gateway.flow.job import ChoiceDelta, GenerationJob, GenerationUpdate
from meshserve.services.gateway.parsers.chat_output import ChoiceOutput, merge_pieces
from meshserve.shared import openai_bodies as bodies
from meshserve.shared import openai_protocol as oai
from meshserve.shared.logprobs import TokenLogprobs

_EMPTY_TAIL = b'[]}\n\n'  # how the SSE bytes of a chunk without choices or usage end


@dataclass
class _Choice:
    """Everything one choice produced, for the aggregated response."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # its first delta (with the echoed prompt) was rendered
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # from its first delta
    text_length: int = 0  # characters streamed so far (text_offset of the next chunk)
    output_ids: list[int] = field(default_factory=list)  # generated tokens only


class Renderer:
    """Shapes one request's output; subclasses shape choices per endpoint."""

    def __init__(self, job: GenerationJob, prompts: Sequence[Any], lookup: bodies.TokenRenderer,
                 response_id: str, created: int | None = None) -> None:
        """`prompts`: the PreparedPrompts (echo); `lookup`: token texts for logprobs."""
        self.job = job
        self.prompts = list(prompts)
        self.lookup = lookup
        self.response_id = response_id
        self.created = bodies.created_timestamp() if created is None else created
        self._choices = [_Choice() for _ in range(job.num_choices)]
        self._ids_sent: set[int] = set()  # choices whose prompt_token_ids were streamed
        self._head = b""  # a chunk's SSE bytes up to its choices (see _event)

    # -- streaming --------------------------------------------------------------------------

    # Whether a choice carries its prompt's `prompt_token_ids` (completions) or the response
    # does (chat: on its role chunks and whole objects), as vLLM places them.
    _prompt_ids_on_choice = True

    def start(self, usage: dict[str, Any] | None = None) -> bytes:
        """SSE bytes sent before the first update (none by default); `usage`: the
        continuous usage stats they carry."""
        return b""

    def chunks(self, update: GenerationUpdate, usage: dict[str, Any] | None = None) -> bytes:
        """The SSE events of one update: one per choice with news."""
        events = []
        for delta in update.choices:
            choice = self._stream_choice(delta)
            if choice is not None:
                first = delta.index not in self._ids_sent and self._prompt_ids_on_choice
                self._ids_sent.add(delta.index)
                events.append(self._event(self._with_token_ids(
                    choice, delta.index, delta.token_ids, first), usage))
        return b"".join(events)

    def _event(self, choice: dict[str, Any], usage: dict[str, Any] | None) -> bytes:
        """`bodies.sse(self._chunk([choice], usage))`, byte for byte, with the envelope (id,
        object, created, model) encoded once per response rather than once per chunk."""
        if not self._head:
            empty = bodies.sse(self._chunk([], None))
            assert empty.endswith(_EMPTY_TAIL), "a chunk's choices come last"
            self._head = empty[:-len(_EMPTY_TAIL)] + b"["
        tail = b"]}\n\n" if usage is None else b'],"usage":' + bodies.dumps(usage) + b"}\n\n"
        return self._head + bodies.dumps(choice) + tail

    def _prompt_ids(self, index: int) -> list[int] | None:
        """The prompt token ids of choice `index` (None for embeddings, as vLLM: no ids)."""
        prompt = self.prompts[index // self.job.params.n]
        return None if prompt.embeds is not None else list(prompt.token_ids)

    @property
    def _tokens_are_news(self) -> bool:
        """Whether held-back tokens (no text yet) still make a chunk: their logprobs or ids
        were asked for."""
        return self.job.wants_logprobs or self.job.options.return_token_ids

    def _with_token_ids(self, choice: dict[str, Any], index: int, token_ids: list[int],
                        with_prompt: bool) -> dict[str, Any]:
        """A choice with vLLM's `token_ids` (and, first, `prompt_token_ids`) when asked."""
        if self.job.options.return_token_ids:
            if with_prompt:
                choice["prompt_token_ids"] = self._prompt_ids(index)
            choice["token_ids"] = list(token_ids)
        return choice

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        """The last chunk of `stream_options.include_usage`: no choices, the usage."""
        return bodies.sse(self._chunk([], usage))

    # -- aggregated -------------------------------------------------------------------------

    def add(self, update: GenerationUpdate) -> None:
        """Take an update into the aggregated response."""
        for delta in update.choices:
            choice = self._choices[delta.index]
            if choice.prompt_logprobs is None and delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            text, ids, entries = self._with_echo(delta, choice)
            choice.texts.append(text)
            choice.token_ids.extend(ids)
            choice.output_ids.extend(delta.token_ids)
            choice.logprobs.extend(entries)
            if delta.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole response object."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------

    def _with_echo(self, delta: ChoiceDelta, choice: _Choice
                   ) -> tuple[str, list[int], list[TokenLogprobs | None]]:
        """The delta's text, ids and logprobs, behind the echoed prompt on a choice's first."""
        entries: list[TokenLogprobs | None] = list(delta.logprobs or ())
        text, ids = delta.text, delta.token_ids
        if self.job.echo and not choice.started:
            prompt = self.prompts[delta.index // self.job.params.n]
            text = (prompt.text or "") + text
            if self.job.wants_logprobs and delta.prompt_logprobs is not None:
                ids = [*prompt.token_ids, *ids]
                entries = [*delta.prompt_logprobs, *entries]
        choice.started = True
        return text, ids, entries

    def _stream_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        raise NotImplementedError

    def _prompt_logprobs(self, index: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` of choice `index`'s prompt; None when not asked."""
        if not self.job.options.return_prompt_logprobs:
            return None
        entries = self._choices[index].prompt_logprobs or [None]
        return bodies.prompt_logprobs_field(entries, self.lookup)

    def _with_prompt_logprobs(self, choice: dict[str, Any], index: int) -> dict[str, Any]:
        """A whole response's choice with vLLM's fields: `token_ids` and (on a completion's
        choice) `prompt_token_ids` and `prompt_logprobs`, null when not asked."""
        asked = self.job.options.return_token_ids
        choice["token_ids"] = list(self._choices[index].output_ids) if asked else None
        if self._prompt_ids_on_choice:
            choice["prompt_logprobs"] = self._prompt_logprobs(index)
            choice["prompt_token_ids"] = self._prompt_ids(index) if asked else None
        return choice

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None
               ) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    """`text_completion` objects and chunks (legacy completions)."""

    def _logprobs(self, ids: list[int], entries: list[TokenLogprobs | None],
                  offset: int) -> dict[str, Any] | None:
        if not self.job.wants_logprobs:
            return None
        return bodies.completion_logprobs(ids, entries, self.lookup, offset)

    def _stream_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        choice = self._choices[delta.index]
        text, ids, entries = self._with_echo(delta, choice)
        if not _has_news(text, ids, delta, self._tokens_are_news):
            return None
        logprobs = self._logprobs(ids, entries, choice.text_length)
        choice.text_length += len(text)
        return bodies.completion_choice(delta.index, text, delta.finish_reason, delta.stop_reason,
                                     logprobs)

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None
               ) -> dict[str, Any]:
        return bodies.completion_chunk(self.response_id, self.created, self.job.model, choices,
                                    usage)

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = [self._with_prompt_logprobs(bodies.completion_choice(
            i, "".join(c.texts), c.finish_reason, c.stop_reason,
            self._logprobs(c.token_ids, c.logprobs, 0)), i) for i, c in enumerate(self._choices)]
        return bodies.completion_response(self.response_id, self.created, self.job.model, choices,
                                       usage)


class ChatRenderer(Renderer):
    """`chat.completion` objects and `chat.completion.chunk`s; with a tool choice or a
    reasoning parser, each choice's text is read back into message fields."""

    def __init__(self, job: GenerationJob, prompts: Sequence[Any], lookup: bodies.TokenRenderer,
                 response_id: str, created: int | None = None) -> None:
        super().__init__(job, prompts, lookup, response_id, created)
        settings = job.chat_output
        self._outputs = ([ChoiceOutput(settings) for _ in range(job.num_choices)]
                         if settings is not None else None)

    def _logprobs(self, entries: list[TokenLogprobs | None]) -> dict[str, Any] | None:
        if not self.job.wants_logprobs:
            return None
        return bodies.chat_logprobs([e for e in entries if e is not None], self.lookup)

    _prompt_ids_on_choice = False

    def start(self, usage: dict[str, Any] | None = None) -> bytes:
        """Each choice's first chunk: the role with empty content (as OpenAI), with vLLM's
        `prompt_token_ids` when asked; then, with `echo`, the final message's content."""
        events = []
        for i in range(self.job.num_choices):
            chunk = self._chunk([bodies.chat_delta_choice(i, "", role=self.job.role)], usage)
            if self.job.options.return_token_ids:
                chunk["prompt_token_ids"] = self._prompt_ids(i)
            events.append(bodies.sse(chunk))
        if self.job.echo_text:
            events += [bodies.sse(self._chunk([bodies.chat_delta_choice(i, self.job.echo_text)],
                                              usage)) for i in range(self.job.num_choices)]
        return b"".join(events)

    def _stream_choice(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        if self._outputs is not None:
            return self._parsed_stream_choice(delta, self._outputs[delta.index])
        if not _has_news(delta.text, delta.token_ids, delta, self._tokens_are_news):
            return None
        return bodies.chat_delta_choice(
            delta.index, delta.text if delta.text or delta.finish_reason is None else None,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            logprobs=self._logprobs(list(delta.logprobs or ())))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None
               ) -> dict[str, Any]:
        return bodies.chat_chunk(self.response_id, self.created, self.job.model, choices, usage)

    def _parsed_stream_choice(self, delta: ChoiceDelta, output: ChoiceOutput
                              ) -> dict[str, Any] | None:
        pieces = output.feed(delta.text)
        if delta.finish_reason is not None:
            pieces += output.finish()
        fields = merge_pieces(pieces)
        if not fields and delta.finish_reason is None and not (
                self._tokens_are_news and delta.token_ids):
            return None
        finish = self._finish_reason(delta.finish_reason, output.called)
        return {"index": delta.index, "delta": fields,
                "logprobs": self._logprobs(list(delta.logprobs or ())),
                "finish_reason": finish, "stop_reason": delta.stop_reason}

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """"tool_calls" when the model called tools of its own choice or of a required
        choice; a named function's call ends with the model's own reason (as OpenAI)."""
        settings = self.job.chat_output
        if reason == "stop" and called and settings is not None and (
                settings.tool_choice.mode != "named"):
            return "tool_calls"
        return reason

    def response(self, usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self._choices):
            choice = bodies.chat_choice(i, "".join(c.texts), c.finish_reason, c.stop_reason,
                                     self._logprobs(c.logprobs))
            if self._outputs is not None:
                fields, called = self._outputs[i].message("".join(c.texts), c.finish_reason)
                choice["message"].update(fields)
                choice["finish_reason"] = self._finish_reason(c.finish_reason, called)
            choice["message"]["role"] = self.job.role
            if self.job.echo_text:
                choice["message"]["content"] = self.job.echo_text + (
                    choice["message"]["content"] or "")
            choices.append(self._with_prompt_logprobs(choice, i))
        response = bodies.chat_response(self.response_id, self.created, self.job.model, choices,
                                        usage)
        response["prompt_logprobs"] = self._prompt_logprobs(0)
        response["prompt_token_ids"] = (self._prompt_ids(0) if self.job.options.return_token_ids
                                        else None)
        return response


def _has_news(text: str, token_ids: list[int], delta: ChoiceDelta, logprobs: bool) -> bool:
    """Whether a choice's chunk says anything: text, a finish, or logprobs of held tokens."""
    return bool(text) or delta.finish_reason is not None or (logprobs and bool(token_ids))


def renderer_for(job: GenerationJob, prompts: Sequence[Any],
                 lookup: bodies.TokenRenderer) -> Renderer:
    """The renderer of `job`'s endpoint, with a fresh response id."""
    if job.options.return_tokens_as_token_ids:
        lookup = oai.TokenIdNames()
    if job.chat:
        return ChatRenderer(job, prompts, lookup, bodies.chat_completion_id())
    return CompletionRenderer(job, prompts, lookup, bodies.completion_id())
