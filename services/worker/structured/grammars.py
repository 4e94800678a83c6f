"""Structured outputs in the worker, the compiling side: grammars compiled with xgrammar,
and a matcher per sequence (the engine core applies them: engine/structured_output.py).

    grammars = GrammarCompiler(source, vocab_size=V, eos_token_ids=eos)
    future = grammars.submit(spec)          # compiled on a pool thread, cached by spec
    matcher = new_matcher(future.result(), stop_ids)   # one per sequence

The compiler needs the model's tokenizer (xgrammar walks its vocabulary once to know
which bytes each token spells); it is loaded on a pool thread the first time, so a
worker whose requests never ask for structured outputs never pays for it. Compiling
happens off the engine thread: a request waits for its grammar outside the engine, and
the others run meanwhile. The per-step work is one batched bitmask fill across all
constrained rows (xgrammar's C++ threads) and one masking op on the device.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.structured_outputs import StructuredKind, StructuredOutputs

log = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "none")
# Most whitespace characters between two JSON elements: enough for pretty-printing seven
# levels deep, and a model can no longer loop on whitespace until max_tokens.
MAX_JSON_WHITESPACE = 16
# Compiled grammars kept by spec (beside xgrammar's own cache, which keys on its inputs
# but still costs a schema conversion per call).
_CACHE_ENTRIES = 256
_PARAM = "structured_outputs"


class GrammarCompiler:
    """Compiles `StructuredOutputs` to xgrammar grammars for one model's vocabulary."""

    def __init__(self, tokenizer_folder: Callable[[], Path | None], *, vocab_size: int,
                 eos_token_ids: Sequence[int], backend: str = "xgrammar",
                 threads: int = 2) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {BACKENDS}, "
                             f"got {backend!r}")
        self.backend = backend
        self.vocab_size = vocab_size
        self._folder = tokenizer_folder
        self._eos = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._tokenizer: Any = None
        self._cache: dict[tuple[str, str, bool], Future[Any]] = {}
        self._preload: Future[Any] | None = None
        if backend != "none":
            # Here, not first on a pool thread: transformers' lazy imports are not safe to
            # race with the engine's own (seen as a failed import on a GPU worker).
            import xgrammar  # noqa: F401

    def preload(self) -> None:
        """Start loading the tokenizer in the background (first requests then wait less)."""
        if self.backend != "none" and self._preload is None:
            self._preload = self._pool.submit(self._get_compiler)
            self._preload.add_done_callback(_log_failure)

    def wait_preloaded(self, timeout_s: float | None = None) -> bool:
        """Block until the preload has ended, loaded or failed (a failure is logged), or
        `timeout_s` has passed; whether it has ended. What it builds (the tokenizer,
        transformers' module tables, xgrammar's vocabulary) lives as long as the process,
        so a server settles its heap after this."""
        if self._preload is None:
            return True
        done, _ = futures.wait([self._preload], timeout=timeout_s)
        return bool(done)

    def submit(self, spec: StructuredOutputs) -> Future[Any]:
        """The compiled grammar of `spec`, on its way (done at once when cached).

        The future fails with InvalidRequestError for a spec xgrammar rejects."""
        self._check_usable()
        with self._lock:
            future = self._cache.get(spec.key)
            if future is None or (future.done() and future.exception() is not None):
                if len(self._cache) >= _CACHE_ENTRIES:
                    self._cache.pop(next(iter(self._cache)))
                future = self._cache[spec.key] = self._pool.submit(self._compile, spec)
            return future

    def compile(self, spec: StructuredOutputs) -> Any:
        """`submit(spec).result()`: compiles on the calling thread's behalf and waits."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_usable(self) -> None:
        if self.backend == "none":
            raise InvalidRequestError("structured outputs are switched off on this worker "
                                      "(--structured-outputs-backend none)", param=_PARAM)

    def submit_bad_words(self, words: Sequence[str]) -> Future[tuple[tuple[int, ...], ...]]:
        """`bad_word_ids(words)` on a pool thread (the tokenizer may still be loading)."""
        return self._pool.submit(self.bad_word_ids, words)

    def bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's token ids, as written and after a space (as vLLM tokenizes them)."""
        tokenizer = self._get_tokenizer("bad_words")
        found: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    found[ids] = None
        return tuple(found)

    def _get_tokenizer(self, param: str) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                folder = self._folder()
                if folder is None:
                    raise InvalidRequestError(f"{param} needs the model's tokenizer, and this "
                                              "worker's model has none", param=param)
                self._tokenizer = AutoTokenizer.from_pretrained(str(folder),
                                                                local_files_only=True)
            return self._tokenizer

    def _get_compiler(self) -> Any:
        tokenizer = self._get_tokenizer(_PARAM)
        with self._lock:
            if self._compiler is None:
                self._compiler = self._load_compiler(tokenizer)
            return self._compiler

    def _load_compiler(self, tokenizer: Any) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self._eos or None)
        log.info("structured outputs: xgrammar ready for a vocabulary of %d", self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=4)

    def _compile(self, spec: StructuredOutputs) -> Any:
        compiler = self._get_compiler()
        try:
            return _compile_spec(compiler, spec)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse errors
            what = _KIND_NAMES[spec.kind]
            raise InvalidRequestError(f"invalid {what}: {_first_line(exc)}",
                                      param=_PARAM) from None


_KIND_NAMES = {
    StructuredKind.JSON: "JSON schema",
    StructuredKind.JSON_OBJECT: "JSON object constraint",
    StructuredKind.REGEX: "regular expression",
    StructuredKind.CHOICE: "choice list",
    StructuredKind.GRAMMAR: "grammar",
    StructuredKind.STRUCTURAL_TAG: "structural tag",
}


def _compile_spec(compiler: Any, spec: StructuredOutputs) -> Any:
    kind = spec.kind
    if kind is StructuredKind.JSON:
        schema = strict_json_strings(orjson.loads(spec.spec))
        return compiler.compile_json_schema(orjson.dumps(schema).decode(),
                                            any_whitespace=spec.any_whitespace,
                                            max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if kind is StructuredKind.JSON_OBJECT:
        return compiler.compile_builtin_json_grammar()
    if kind is StructuredKind.REGEX:
        return compiler.compile_regex(spec.spec)
    if kind is StructuredKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(spec.choice_list))
    if kind is StructuredKind.GRAMMAR:
        return compiler.compile_grammar(spec.spec)
    if kind is StructuredKind.STRUCTURAL_TAG:
        return compiler.compile_structural_tag(orjson.dumps(
            structural_tag_format(orjson.loads(spec.spec))).decode())
    raise InvalidRequestError(f"unknown structured output kind {kind}", param=_PARAM)


# One character of a JSON string written without escapes: anything but a control
# character, a quote, a backslash or a UTF-16 surrogate (not valid UTF-8 either).
_JSON_CHAR = r'[^\x00-\x1f"\\\ud800-\udfff]'
# Schema keys whose values are schemas, and those whose values are lists or maps of them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def strict_json_strings(schema: Any) -> Any:
    """`schema` with each length-bounded plain string turned into an equivalent pattern.

    xgrammar's rule for a string with minLength/maxLength lets raw control characters
    (a tab, a backspace) and UTF-16 surrogates into it, which JSON and UTF-8 forbid, so a
    strict parser rejects the output. Its pattern rule keeps to JSON's string syntax, but
    cannot repeat escapes: such strings are written without any (no quote, backslash or
    newline inside them).
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^{_JSON_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = strict_json_strings(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_json_strings(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_json_strings(s) for name, s in out[key].items()}
    return out


def structural_tag_format(tag: dict[str, Any]) -> dict[str, Any]:
    """A structural tag in xgrammar's format: the older shape (`structures` of begin /
    schema / end, and `triggers`, as OpenAI-style clients send it) becomes triggered tags."""
    if "format" in tag or "structures" not in tag:
        return tag
    tags = [{"begin": s.get("begin", ""), "end": s.get("end", ""),
             "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
            for s in tag["structures"]]
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}}


def choice_grammar(options: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are `options`, exactly."""
    return "root ::= " + " | ".join(_ebnf_literal(o) for o in options)


def _ebnf_literal(text: str) -> str:
    """`text` as a double-quoted EBNF string (xgrammar reads C-style escapes)."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _log_failure(future: Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("structured outputs unavailable: %s", exc)


def new_matcher(grammar: Any, stop_token_ids: Sequence[int]) -> Any:
    """A fresh matcher of `grammar` for one sequence; its grammar ends on `stop_token_ids`."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(grammar, override_stop_tokens=list(stop_token_ids) or None)
