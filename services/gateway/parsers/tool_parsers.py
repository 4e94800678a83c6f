"""Tool-call parsers: turn model text into OpenAI tool calls, whole or streamed.

Formats follow vLLM's parsers of the same names (`hermes`, `qwen3`, `llama3_json`,
`mistral`, `qwen3_coder`). Each parser is a small state machine over the text: plain
text is content, and a start marker opens a call block that is parsed once it closes
(or when the output ends). `extract` runs the same machine over the whole text, so a
streamed parse and a whole-text parse agree by construction, however the text is cut.

Conventions shared by every parser:
- a block that does not parse stays content, marker included, and yields no call;
- whitespace right after a call block is dropped (it only separates calls);
- streaming emits a call once its block is complete: one piece with the id and name,
  then its arguments in one piece;
- `arguments` is compact `json.dumps(obj, ensure_ascii=False)` text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _mistral_call_id() -> str:
    # Mistral's chat templates refuse tool call ids other than 9 letters or digits when a
    # conversation sends the calls back; vLLM's mistral parser makes its ids the same way.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCall:
    """One function call found in model output."""

    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=_new_call_id)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base parser: content outside `START ... END` blocks, one or more calls per block.

    Subclasses set `START` (and `END`, or None when a block runs until the next `START`
    or the end of output) and implement `_parse_block`, returning the calls in a block's
    body or None when the body is malformed.
    """

    START: ClassVar[str] = ""
    END: ClassVar[str | None] = None

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._tools = tools or []
        self._buf = ""  # text not yet decided
        self._in_block = False
        self._block_text = ""  # the marker that opened the current block
        self._skip_ws = False  # drop whitespace that follows a call block
        self._n_calls = 0

    # -- public interface --------------------------------------------------------

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Parse a whole output: (content or None when empty, calls)."""
        fresh = type(self)(self._tools)
        pieces = fresh.feed(text) + fresh.finish()
        content = "".join(p["content"] for p in pieces if "content" in p)
        calls: list[ToolCall] = []
        for piece in pieces:
            for tc in piece.get("tool_calls", []):
                fn = tc["function"]
                if "id" in tc:
                    calls.append(ToolCall(fn["name"], "", tc["id"]))
                else:
                    last = calls[tc["index"]]
                    calls[tc["index"]] = ToolCall(
                        last.name, last.arguments + fn["arguments"], last.id
                    )
        return (content or None), calls

    def feed(self, delta: str) -> list[dict]:
        """Consume a piece of output; return OpenAI chat-chunk delta pieces decided so far."""
        self._buf += delta
        out: list[dict] = []
        while True:
            if self._in_block:
                if not self._step_block(out):
                    return out
            elif not self._step_text(out):
                return out

    def finish(self) -> list[dict]:
        """Flush what was held back: an unclosed block is parsed as if closed."""
        out: list[dict] = []
        # Whatever is buffered inside an open block is its whole body: `feed` has
        # already closed every block whose end it saw.
        if self._in_block:
            self._close_block(self._buf, out)
            self._buf = ""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
        if self._buf:
            out.append({"content": self._buf})
            self._buf = ""
        return out

    # -- machine -----------------------------------------------------------------

    def _block_start(self, buf: str) -> tuple[int, int] | None:
        """(index, marker length) of the next block start in `buf`, or None."""
        i = buf.find(self.START)
        return None if i < 0 else (i, len(self.START))

    def _hold_back(self, buf: str) -> int:
        """How many trailing characters might still turn into a block start."""
        return _partial_suffix(buf, self.START)

    def _step_text(self, out: list[dict]) -> bool:
        """Emit content up to the next block start; True when a block was entered."""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_ws = False
        found = self._block_start(self._buf)
        if found is None:
            keep = self._hold_back(self._buf)
            text, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            if text:
                out.append({"content": text})
            return False
        i, n = found
        if i:
            out.append({"content": self._buf[:i]})
        self._block_text = self._buf[i : i + n]
        self._buf = self._buf[i + n :]
        self._in_block = True
        return True

    def _step_block(self, out: list[dict]) -> bool:
        """Close the open block if its end is in the buffer; True when closed."""
        if self.END is not None:
            j = self._buf.find(self.END)
            if j < 0:
                return False
            body, self._buf = self._buf[:j], self._buf[j + len(self.END) :]
            self._close_block(body, out, self.END)
            return True
        found = self._block_start(self._buf)
        if found is None:
            return False
        j = found[0]
        body, self._buf = self._buf[:j], self._buf[j:]
        self._close_block(body, out)
        return True

    def _close_block(self, body: str, out: list[dict], end: str = "") -> None:
        self._in_block = False
        calls = self._parse_block(body)
        if calls is None:
            out.append({"content": self._block_text + body + end})
            return
        for call in calls:
            out.extend(self._call_pieces(call))
        self._skip_ws = True

    def _call_pieces(self, call: ToolCall) -> list[dict]:
        i = self._n_calls
        self._n_calls += 1
        start = {
            "index": i,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        args = {"index": i, "function": {"arguments": call.arguments}}
        return [{"tool_calls": [start]}, {"tool_calls": [args]}]

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError


def _call_from_obj(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from `{"name": ..., <args key>: {...}}`, or None when it has another shape."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            # Some models send arguments already encoded as a JSON string.
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            return ToolCall(obj["name"], _dumps(args)) if isinstance(args, dict) else None
    return ToolCall(obj["name"], "{}")


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""

    START = "<tool_call>"
    END = "</tool_call>"

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        call = _call_from_obj(obj, ("arguments", "parameters"))
        return None if call is None else [call]


class Llama3JsonToolParser(ToolParser):
    """Output that starts with `<|python_tag|>` or `{`: JSON calls separated by `;`.

    Each call is `{"name": ..., "parameters": {...}}`; calls are emitted when the output
    ends, since any later object may make the whole output malformed.
    """

    START = "<|python_tag|>"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._decided = False  # whether the output's start has been seen

    def _block_start(self, buf: str) -> tuple[int, int] | None:
        if self._decided:
            return None
        stripped = buf.lstrip()
        lead = len(buf) - len(stripped)
        # Leading whitespace joins the marker, so it is dropped when the calls parse
        # and given back as content when they do not.
        if stripped.startswith(self.START):
            self._decided = True
            return 0, lead + len(self.START)
        if stripped.startswith("{"):
            self._decided = True
            return 0, lead
        if stripped and not self.START.startswith(stripped):
            self._decided = True
        return None

    def _hold_back(self, buf: str) -> int:
        return 0 if self._decided else len(buf)

    def _step_block(self, out: list[dict]) -> bool:
        return False  # the block runs to the end of output

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos, n = 0, len(body)
        while True:
            while pos < n and body[pos].isspace():
                pos += 1
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return None
            call = _call_from_obj(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            while pos < n and body[pos].isspace():
                pos += 1
            if pos == n:
                return calls
            if body[pos] != ";":
                return None
            pos += 1


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`.

    A block runs until the next `[TOOL_CALLS]` or the end of output.
    """

    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        calls = self._parse_calls(body)
        return None if calls is None else [replace(c, id=_mistral_call_id()) for c in calls]

    def _parse_calls(self, body: str) -> list[ToolCall] | None:
        if self.ARGS in body:
            name, _, args_text = body.partition(self.ARGS)
            try:
                args = json.loads(args_text)
            except json.JSONDecodeError:
                return None
            name = name.strip()
            if not name or not isinstance(args, dict):
                return None
            return [ToolCall(name, _dumps(args))]
        try:
            items = json.loads(body)
        except json.JSONDecodeError:
            return None
        if isinstance(items, dict):
            items = [items]
        if not isinstance(items, list) or not items:
            return None
        calls = [_call_from_obj(item, ("arguments", "parameters")) for item in items]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]


_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _schema_type(schema: dict) -> str:
    t = schema.get("type", "string")
    if isinstance(t, list):  # e.g. ["integer", "null"]: the non-null member decides
        t = next((x for x in t if x != "null"), "string")
    return str(t).lower()


def _convert(value: str, schema: dict | None) -> Any:
    """A parameter's text converted by its JSON-schema type; text kept when it does not fit."""
    if schema is None:
        return value
    t = _schema_type(schema)
    if value.lower() == "null" and t != "string":
        return None
    try:
        if t == "integer":
            return int(value)
        if t == "number":
            num = float(value)
            return (
                int(num)
                if num.is_integer() and "." not in value and "e" not in value.lower()
                else num
            )
        if t == "boolean":
            low = value.strip().lower()
            return low == "true" if low in ("true", "false") else value
        if t in ("object", "array"):
            return json.loads(value)
    except ValueError:  # json.JSONDecodeError is a ValueError
        return value
    return value


class Qwen3CoderToolParser(ToolParser):
    """XML-like calls: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>...`.

    Parameter values are converted by the type in the request's tool schema.
    """

    START = "<tool_call>"
    END = "</tool_call>"

    def _schema(self, fn_name: str) -> dict[str, dict]:
        for tool in self._tools:
            fn = tool.get("function", tool)
            if fn.get("name") == fn_name:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return props if isinstance(props, dict) else {}
        return {}

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        m = _FUNCTION_RE.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = self._schema(name)
        args: dict[str, Any] = {}
        for pm in _PARAM_RE.finditer(m.group(2)):
            value = pm.group(2)
            # The template puts each value on its own lines; those newlines are not data.
            value = value.removeprefix("\n")
            value = value.removesuffix("\n")
            key = pm.group(1).strip()
            args[key] = _convert(value, props.get(key))
        return [ToolCall(name, _dumps(args))]


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,  # vLLM maps Qwen3 (non-coder) to the hermes format
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}
