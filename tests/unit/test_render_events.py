"""The SSE events of streamed chunks: the envelope encoded once per response gives the same
bytes as encoding each whole chunk (services/gateway/api/render.py)."""

from __future__ import annotations

from typing import Any

import pytest

from meshserve.services.gateway.api.render import renderer_for
from meshserve.services.gateway.flow.job import (
    ChoiceDelta,
    GenerationJob,
    GenerationUpdate,
    PreparedPrompt,
)
from meshserve.shared import openai_bodies as bodies
from meshserve.shared import openai_protocol as oai
from meshserve.shared.openai_bodies import usage as usage_body


def _job(chat: bool, n: int) -> GenerationJob:
    common = {"model": "tiny", "n": n, "stream": True, "max_tokens": 8}
    if chat:
        return GenerationJob.for_chat(
            oai.parse_chat_request({**common, "messages": [{"role": "user", "content": "hi"}]}),
            model="tiny", default_max_tokens=None, arrival=0.0, deadline=1.0)
    body = {**common, "prompt": "hi"}
    return GenerationJob.for_completion(oai.parse_completion_request(body), body, model="tiny",
                                        default_max_tokens=None, arrival=0.0, deadline=1.0)


def _whole_chunks(renderer: Any, update: GenerationUpdate,
                  usage: dict[str, Any] | None) -> bytes:
    """What each event was before: the whole chunk object encoded (on a twin renderer)."""
    events = []
    for delta in update.choices:
        choice = renderer._stream_choice(delta)
        if choice is not None:
            events.append(bodies.sse(renderer._chunk([choice], usage)))
    return b"".join(events)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("with_usage", [False, True])
def test_events_are_the_whole_chunks_encoded(chat: bool, with_usage: bool) -> None:
    job = _job(chat, n=2)
    prompts = [PreparedPrompt([1, 2], text="hi")]
    fast = renderer_for(job, prompts, lookup=None)  # type: ignore[arg-type]
    twin = renderer_for(job, prompts, lookup=None)  # type: ignore[arg-type]
    twin.response_id, twin.created = fast.response_id, fast.created
    usage = usage_body(2, 3, 1) if with_usage else None
    updates = [GenerationUpdate([ChoiceDelta(0, "h\u00e9", [104]), ChoiceDelta(1, '"q"', [34])]),
               GenerationUpdate([ChoiceDelta(0, "", [5])]),  # no news: no event
               GenerationUpdate([ChoiceDelta(1, "!", [33], finish_reason="length")]),
               GenerationUpdate([ChoiceDelta(0, "", [], finish_reason="stop",
                                             stop_reason="</s>")])]
    for update in updates:
        expected = _whole_chunks(twin, update, usage)
        assert fast.chunks(update, usage) == expected
    assert fast.chunks(updates[0], usage).count(b"data: ") == 2
    assert fast.response_id.encode() in fast.chunks(updates[2], usage)
