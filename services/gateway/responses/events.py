"""The server-sent events of a streamed /v1/responses answer, in OpenAI's order.

    events = ResponseEvents()
    yield events.start(pending, message_id)   # response.created, response.in_progress, and
                                              #   the message item and its text part opened
    yield events.text(message_id, delta)      # response.output_text.delta, as generated
    yield events.finish(response, streamed)   # every item closed, then response.completed
                                              #   (or response.incomplete)

Each event is `event: <type>` plus `data: <json>` whose `sequence_number` counts from 0.
Plain text streams as it is generated; when the output has to be read back first (tool
calls, reasoning), `start` opens no item and `finish` sends every item whole.
"""

from __future__ import annotations

from typing import Any

import orjson

from meshserve.shared.errors import MeshError

# What closes a message item that was streamed as it was generated.
_CLOSING = ("response.output_text.done", "response.content_part.done",
            "response.output_item.done")


class ResponseEvents:
    """One response's events, numbered as they are made."""

    def __init__(self) -> None:
        self._number = 0

    def event(self, name: str, data: dict[str, Any]) -> bytes:
        """One SSE event of type `name`, carrying `data` and the next sequence number."""
        body = orjson.dumps({"type": name, "sequence_number": self._number, **data})
        self._number += 1
        return b"event: " + name.encode() + b"\ndata: " + body + b"\n\n"

    def start(self, pending: dict[str, Any], message_id: str | None) -> bytes:
        """The response announced (`pending`: in progress); with `message_id`, its message
        item and text part opened for the text to stream into."""
        out = [self.event("response.created", {"response": pending}),
               self.event("response.in_progress", {"response": pending})]
        if message_id is not None:
            item = {"type": "message", "id": message_id, "status": "in_progress",
                    "role": "assistant", "content": []}
            out += [self.event("response.output_item.added", {"output_index": 0, "item": item}),
                    self.event("response.content_part.added", {
                        "output_index": 0, "item_id": message_id, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}})]
        return b"".join(out)

    def text(self, message_id: str, delta: str,
             logprobs: list[dict[str, Any]] | None = None) -> bytes:
        """Text generated into the message item opened by `start` (with the logprobs of its
        tokens when they were asked for)."""
        return self.event("response.output_text.delta", {
            "output_index": 0, "item_id": message_id, "content_index": 0, "delta": delta,
            "logprobs": logprobs or []})

    def finish(self, response: dict[str, Any], streamed_message: bool) -> bytes:
        """Every output item (only closed, for a message streamed since `start`), then the
        final response."""
        out = []
        for index, item in enumerate(response["output"]):
            events = item_events(index, item)
            if streamed_message and item["type"] == "message":
                events = [e for e in events if e[0] in _CLOSING]
            out += [self.event(name, data) for name, data in events]
        done = ("response.completed" if response["status"] == "completed"
                else "response.incomplete")
        out.append(self.event(done, {"response": response}))
        return b"".join(out)

    def error(self, error: MeshError) -> bytes:
        """The event that ends a stream cut short by `error`."""
        return self.event("error", {"code": error.kind, "message": error.message,
                                    "param": error.param})


def item_events(index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events that send one finished output item whole: added, its content, done."""
    common = {"output_index": index, "item_id": item["id"]}
    added = ("response.output_item.added", {"output_index": index, "item": {
        **item, "status": "in_progress", **_EMPTY[item["type"]]}})
    done = ("response.output_item.done", {"output_index": index, "item": item})
    if item["type"] == "function_call":
        return [added,
                ("response.function_call_arguments.delta", {**common,
                                                            "delta": item["arguments"]}),
                ("response.function_call_arguments.done", {**common,
                                                           "arguments": item["arguments"]}),
                done]
    part = item["content"][0]
    at = {**common, "content_index": 0}
    if item["type"] == "reasoning":
        return [added,
                ("response.reasoning_text.delta", {**at, "delta": part["text"]}),
                ("response.reasoning_text.done", {**at, "text": part["text"]}),
                done]
    return [added,
            ("response.content_part.added", {**at, "part": {**part, "text": "",
                                                              "logprobs": []}}),
            ("response.output_text.delta", {**at, "delta": part["text"],
                                             "logprobs": part["logprobs"]}),
            ("response.output_text.done", {**at, "text": part["text"],
                                           "logprobs": part["logprobs"]}),
            ("response.content_part.done", {**at, "part": part}),
            done]


# What an item holds when `response.output_item.added` announces it.
_EMPTY: dict[str, dict[str, Any]] = {
    "message": {"content": []}, "reasoning": {"content": []},
    "function_call": {"arguments": ""}}
