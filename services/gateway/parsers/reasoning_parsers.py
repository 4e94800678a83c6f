"""Reasoning parsers: split model text into reasoning and content, whole or streamed.

Formats follow vLLM's `deepseek_r1` and `qwen3` parsers. vLLM first returned the
reasoning under `reasoning_content` (the DeepSeek convention), then renamed it to
`reasoning` (vLLM RFC #27755, late 2025) and later removed the deprecated
`reasoning_content` from its responses; current vLLM emits only `reasoning`, in
messages and in stream deltas. The field name is therefore a constructor argument
defaulting to `reasoning`; pass `field="reasoning_content"` for clients that still
read the older name (many OpenAI-compatible clients read either).

`extract` runs the streaming machine over the whole text, so a streamed parse and a
whole-text parse agree however the text is cut.
"""

from __future__ import annotations

from typing import ClassVar

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_FIELD = "reasoning"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Base parser: optional leading `<think>`, reasoning up to `</think>`, then content.

    `REQUIRE_START` decides what an output without a leading `<think>` is: reasoning
    (the template opened the think block in the prompt) or plain content.
    """

    REQUIRE_START: ClassVar[bool] = False

    def __init__(self, field: str = REASONING_FIELD) -> None:
        self.field = field
        self._buf = ""
        self._state = "start"  # start -> reasoning -> content

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Parse a whole output: (reasoning, content), each None when empty."""
        fresh = type(self)(self.field)
        pieces = fresh.feed(text) + fresh.finish()
        reasoning = "".join(p[self.field] for p in pieces if self.field in p)
        content = "".join(p["content"] for p in pieces if "content" in p)
        return reasoning or None, content or None

    def feed(self, delta: str) -> list[dict]:
        """Consume a piece of output; return `{field: piece}` / `{"content": piece}` deltas."""
        self._buf += delta
        out: list[dict] = []
        if self._state == "start":
            self._step_start()
        if self._state == "reasoning":
            self._step_reasoning(out)
        if self._state == "content" and self._buf:
            out.append({"content": self._buf})
            self._buf = ""
        return out

    def finish(self) -> list[dict]:
        """Flush what was held back as a possible marker prefix."""
        out: list[dict] = []
        if self._state == "start":
            # Too short to hold `<think>`: it is whatever an unmarked output is.
            self._state = "content" if self.REQUIRE_START else "reasoning"
        if self._buf:
            key = self.field if self._state == "reasoning" else "content"
            out.append({key: self._buf})
            self._buf = ""
        return out

    def _step_start(self) -> None:
        if self._buf.startswith(THINK_START):
            self._buf = self._buf[len(THINK_START) :]
            self._state = "reasoning"
        elif not THINK_START.startswith(self._buf):
            self._state = "content" if self.REQUIRE_START else "reasoning"

    def _step_reasoning(self, out: list[dict]) -> None:
        j = self._buf.find(THINK_END)
        if j >= 0:
            if j:
                out.append({self.field: self._buf[:j]})
            self._buf = self._buf[j + len(THINK_END) :]
            self._state = "content"
            return
        keep = _partial_suffix(self._buf, THINK_END)
        text = self._buf[: len(self._buf) - keep]
        if text:
            out.append({self.field: text})
        self._buf = self._buf[len(self._buf) - keep :]


class DeepSeekR1ReasoningParser(ReasoningParser):
    """Reasoning until `</think>`; the opening `<think>` is often in the prompt, so optional.

    An output that never closes the think block is all reasoning.
    """

    REQUIRE_START = False


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when the output starts with `<think>`; otherwise all content.

    An output that opens but never closes the think block (cut off) is all reasoning.
    """

    REQUIRE_START = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}
