"""The server-sent events of a streamed /v1/messages answer, in Anthropic's order.

    events = MessageEvents()
    yield events.start(pending)        # message_start, ping
    yield events.text(delta)           # content_block_start (the first time), text_delta
    yield events.finish(message)       # the open block closed, the blocks not streamed sent
                                       #   whole, message_delta (stop reason, usage),
                                       #   message_stop

Each event is `event: <type>` plus `data: <json>` whose `type` repeats it. Plain text
streams as it is generated; output read back by parsers (tool calls, reasoning) is only
known at the end and is sent whole then: a block's start, one delta (text_delta,
thinking_delta, or input_json_delta with the whole input), its stop.
"""

from __future__ import annotations

from typing import Any

import orjson


def event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event of type `name`."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) \
        + b"\n\n"


class MessageEvents:
    """One message's events; counts its content blocks and knows whether text is open."""

    def __init__(self) -> None:
        self._blocks = 0  # content blocks started
        self._text_open = False  # the last block is text still being streamed

    def start(self, pending: dict[str, Any]) -> bytes:
        """The message announced (`pending`: no content yet)."""
        return event("message_start", {"message": pending}) + event("ping", {})

    def text(self, delta: str) -> bytes:
        """Text as it is generated, into a text block opened by its first piece."""
        if not delta:
            return b""
        out = b""
        if not self._text_open:
            out = self._block_start({"type": "text", "text": ""})
            self._text_open = True
        return out + self._delta({"type": "text_delta", "text": delta})

    def finish(self, message: dict[str, Any], streamed_text: bool) -> bytes:
        """The end: the streamed text block closed (`streamed_text`: the message's text was
        sent as generated), every other block whole, then the stop reason and usage."""
        out = []
        if self._text_open:
            out.append(self._block_stop())
        for block in message["content"]:
            if not (streamed_text and block["type"] == "text"):
                out.append(self._whole(block))
        out.append(event("message_delta", {
            "delta": {"stop_reason": message["stop_reason"],
                      "stop_sequence": message["stop_sequence"]},
            "usage": message["usage"]}))
        out.append(event("message_stop", {}))
        return b"".join(out)

    def _whole(self, block: dict[str, Any]) -> bytes:
        """A finished block: its start (empty), its content as one delta, its stop."""
        kind = block["type"]
        if kind == "tool_use":
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta",
                     "partial_json": orjson.dumps(block["input"]).decode()}
        elif kind == "thinking":
            empty = {**block, "thinking": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            empty = {**block, "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        return self._block_start(empty) + self._delta(delta) + self._block_stop()

    def _block_start(self, block: dict[str, Any]) -> bytes:
        return event("content_block_start", {"index": self._blocks, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self._blocks, "delta": delta})

    def _block_stop(self) -> bytes:
        data = event("content_block_stop", {"index": self._blocks})
        self._blocks += 1
        self._text_open = False
        return data


def error_event(body: dict[str, Any]) -> bytes:
    """The event that ends a stream cut short (`body`: Anthropic's error body)."""
    return event("error", {"error": body["error"]})
