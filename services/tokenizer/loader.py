"""Loading a model's tokenizer, and the thin `Tokenizer` wrapper the services use.

The wrapper hides transformers behind the few calls meshserve needs: encode,
chat templates, decode (what the incremental detokenizer calls), and the token
text/bytes that OpenAI logprobs show.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from meshserve.shared.errors import InvalidRequestError, ModelLoadError
from meshserve.shared.gguf_export import exported_folder

# transformers marks "no limit" with a huge sentinel (int(1e30)).
_NO_MAX_LENGTH = 10**12
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Fill-in-the-middle tokens (before the prefix, before the suffix, before the middle), as
# StarCoder / SantaCoder, Qwen2.5-Coder / CodeGemma and DeepSeek-Coder spell them.
_FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
               # DeepSeek-Coder's, with full-width bars: <｜fim▁begin｜> ...
               ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
                "<\uff5cfim\u2581end\uff5c>"))
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Names that apply_chat_template itself takes; a request may not set them
# through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


class ModelSourceLike(Protocol):
    """Where a model lives (see `meshserve.shared.model_source.ModelSource`, a frozen
    dataclass: the members are read-only)."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> Path: ...
    @property
    def format(self) -> str: ...
    @property
    def gguf_file(self) -> Path | None: ...


class Tokenizer:
    """A loaded tokenizer: encode, chat templates, decode, token metadata.

    `decode` never cleans up tokenization spaces (it must be concatenative for
    incremental decoding, as in vLLM). `spaces_between_special_tokens=False`
    renders added tokens as their raw text with nothing inserted around them;
    True keeps whatever spacing the tokenizer's own decoder produces (byte-level
    decoders add none, as with vLLM's fast-tokenizer path).
    """

    def __init__(self, hf: Any, *, name: str = "",
                 extra_eos_token_ids: Sequence[int] = ()) -> None:
        self.hf = hf
        self.name = name
        # The Rust tokenizer when there is one: calling it directly skips
        # transformers' per-call Python overhead on the detokenization hot path.
        self._backend = getattr(hf, "_tokenizer", None) if getattr(hf, "is_fast", False) else None
        self._added: dict[int, str] = {i: str(t) for i, t in hf.added_tokens_decoder.items()}
        special = {i for i, t in hf.added_tokens_decoder.items() if getattr(t, "special", False)}
        self._special_ids = frozenset(special | set(hf.all_special_ids))
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos, *extra_eos_token_ids]))
        self._byte_decoder = self._make_byte_decoder()
        self._token_text_cache: dict[int, str] = {}

    # -- metadata ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (len(tokenizer))."""
        return len(self.hf)

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens` removes."""
        return self._special_ids

    @property
    def model_max_length(self) -> int | None:
        """The tokenizer's declared context length, None when it declares none."""
        value = self.hf.model_max_length
        return int(value) if value is not None and value < _NO_MAX_LENGTH else None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    # -- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with BOS and the like when `add_special_tokens`)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of `token_ids` (see the class docstring for the options)."""
        ids = list(token_ids)
        if spaces_between_special_tokens or skip_special_tokens:
            return self._decode_plain(ids, skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            content = self._added.get(token_id)
            if content is None:
                run.append(token_id)
                continue
            if run:
                parts.append(self._decode_plain(run, False))
                run = []
            parts.append(content)
        if run:
            parts.append(self._decode_plain(run, False))
        return "".join(parts)

    def _decode_plain(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=False))

    @functools.cached_property
    def fim_tokens(self) -> tuple[str, str, str] | None:
        """The model's fill-in-the-middle tokens (prefix, suffix, middle), None when it has
        none. A spelling counts only when each of its tokens encodes as one token: a name
        that is in the vocabulary but split by the encoder would feed the model its pieces."""
        unknown = self.hf.unk_token_id
        for spelling in _FIM_TOKENS:
            encoded = [self.encode(token, add_special_tokens=False) for token in spelling]
            if all(len(ids) == 1 and ids[0] != unknown for ids in encoded):
                return spelling
        return None

    def fill_in_middle(self, prefix: str, suffix: str) -> str:
        """The prompt of a fill-in-the-middle completion in the model's FIM tokens, in the
        prefix-suffix-middle order StarCoder, Qwen2.5-Coder and DeepSeek-Coder are trained
        on: the model generates the middle."""
        if self.fim_tokens is None:
            raise _bad("'suffix' is not supported for this model: the model's tokenizer has "
                       "no fill-in-the-middle tokens (such as <fim_prefix>, <fim_suffix>, "
                       "<fim_middle>)", "suffix")
        begin, after, middle = self.fim_tokens
        return f"{begin}{prefix}{after}{suffix}{middle}"

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of the ids (e.g. 'Ġhello' for byte-level BPE)."""
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def token_text(self, token_id: int) -> str:
        """Display text of one token, as logprobs show it."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._decode_plain([token_id], False)
            self._token_text_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (may be part of a UTF-8 character)."""
        token = self.hf.convert_ids_to_tokens(token_id)
        if token is not None and token_id not in self._added:
            if self._byte_decoder is not None:
                decoded = [self._byte_decoder.get(ch) for ch in token]
                if all(b is not None for b in decoded):
                    return bytes(b for b in decoded if b is not None)
            byte_match = _BYTE_TOKEN.match(token)
            if byte_match:  # sentencepiece byte fallback, e.g. <0xE4>
                return bytes([int(byte_match.group(1), 16)])
        return self.token_text(token_id).encode("utf-8")

    def _make_byte_decoder(self) -> dict[str, int] | None:
        decoder = getattr(self._backend, "decoder", None) if self._backend is not None else None
        if decoder is None or type(decoder).__name__ != "ByteLevel":
            return None
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        return {char: byte for byte, char in bytes_to_unicode().items()}

    # -- chat -------------------------------------------------------------------------------

    def render_chat(self, messages: object, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: Mapping[str, Any] | None = None, *,
                    chat_template: str | None = None, content_parts: bool = False) -> str:
        """The prompt text the chat template makes of `messages`.

        `chat_template` (Jinja text) replaces the model's own template when given.
        `content_parts` (vision-language models): content given as parts stays a list of
        text and image parts, as Hugging Face processors pass it to their templates.
        """
        if not (chat_template or self.has_chat_template):
            raise InvalidRequestError(
                f"model {self.name or '(unnamed)'} has no chat template; use /v1/completions "
                "with a prompt instead", param="messages")
        conversation = normalize_messages(messages, content_parts=content_parts)
        kwargs = _check_template_kwargs(chat_template_kwargs)
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message "
                                      "cannot both be true", param="continue_final_message")
        import jinja2
        try:
            text = self.hf.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False,
                chat_template=chat_template or None, **kwargs)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}",
                                      param="messages") from exc
        except ValueError as exc:  # e.g. continue_final_message on a non-assistant turn
            raise InvalidRequestError(f"cannot apply the chat template: {exc}",
                                      param="messages") from exc
        return str(text)

    def apply_chat_template(self, messages: object, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True,
                            chat_template_kwargs: Mapping[str, Any] | None = None,
                            continue_final_message: bool = False, *,
                            chat_template: str | None = None) -> list[int]:
        """Token ids of the rendered chat; the template writes its own BOS, so none is added."""
        text = self.render_chat(messages, tools, add_generation_prompt, continue_final_message,
                                chat_template_kwargs, chat_template=chat_template)
        return self.encode(text, add_special_tokens=False)


def normalize_messages(messages: object, *,
                       content_parts: bool = False) -> list[dict[str, Any]]:
    """Check chat messages and shape them for chat templates.

    Content may be a string or a list of {"type": "text", "text": ...} parts
    (joined with newlines); tool-call arguments given as JSON strings become
    objects, which is what templates expect. With `content_parts`, parts stay a list of
    {"type": "text", "text": ...} and {"type": "image"} parts.
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of messages", "messages")
    return [_normalize_message(message, i, content_parts)
            for i, message in enumerate(messages)]


def count_image_parts(messages: object) -> int:
    """How many {"type": "image"} content parts `messages` hold (0 for malformed ones)."""
    if not isinstance(messages, list):
        return 0
    return sum(1 for message in messages if isinstance(message, dict)
               and isinstance(message.get("content"), list)
               for part in message["content"]
               if isinstance(part, dict) and part.get("type") == "image")


def _normalize_message(message: object, index: int, content_parts: bool) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object", "messages")
    role = message.get("role")
    if not isinstance(role, str) or not role:  # any role reaches the template, as in vLLM
        raise _bad(f"{where}.role must be a non-empty string (such as {', '.join(_ROLES)}); got "
                   f"{role!r}", f"{where}.role")
    out = dict(message)
    content = message.get("content")
    if content is None:
        if not (role == "assistant" and message.get("tool_calls")):
            raise _bad(f"{where}.content is required", f"{where}.content")
        out["content"] = ""
    elif isinstance(content, list):
        out["content"] = (_parts(content, where) if content_parts
                          else _text_parts(content, where))
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or an array of content parts",
                   f"{where}.content")
    if "tool_calls" in message:
        out["tool_calls"] = _tool_calls(message["tool_calls"], where)
    return out


def _checked_parts(parts: list[Any], where: str,
                   kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """`parts`, each an object of one of `kinds` (a text part with its text string)."""
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise _bad(f"{where}.content[{j}]: only {' and '.join(kinds)} parts are "
                       f"supported, got {kind!r}", f"{where}.content")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise _bad(f"{where}.content[{j}].text must be a string", f"{where}.content")
    return parts


def _text_parts(parts: list[Any], where: str) -> str:
    return "\n".join(part["text"] for part in _checked_parts(parts, where, ("text",)))


def _parts(parts: list[Any], where: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": part["text"]} if part["type"] == "text"
            else {"type": "image"} for part in _checked_parts(parts, where, ("text", "image"))]


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}.tool_calls[{j}] must have function.name",
                       f"{where}.tool_calls")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise _bad(f"{where}.tool_calls[{j}].function.arguments is not valid JSON",
                           f"{where}.tool_calls") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError("'chat_template_kwargs' must be an object",
                                  param="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                  param="chat_template_kwargs")
    return dict(kwargs)


def _resolve(source: ModelSourceLike | str | os.PathLike[str]) -> tuple[str, Path, str | None]:
    """(name, folder, gguf file name inside the folder or None) of a model source."""
    gguf: Path | None = None
    if isinstance(source, (str, os.PathLike)):
        path, name = Path(source), str(source)
    else:
        path, name = Path(source.path), source.name
        if getattr(source, "gguf_file", None) is not None:
            gguf = Path(str(source.gguf_file))
    path = path.expanduser().resolve()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    base = path if path.is_dir() else path.parent
    if gguf is None and path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model path {path} is a file but not a .gguf file")
        gguf = path
    if gguf is None and not _has_tokenizer_files(path):
        candidates = sorted(path.glob("*.gguf"))
        if len(candidates) == 1:
            gguf = candidates[0]
    if gguf is None:
        return name, path, None
    gguf = gguf if gguf.is_absolute() else base / gguf  # relative to the model folder
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file {gguf} does not exist")
    return name, gguf.parent, gguf.name


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).exists() for f in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def _generation_eos(folder: Path) -> list[int]:
    """EOS ids from generation_config.json (Llama 3 lists several there)."""
    config = folder / "generation_config.json"
    if not config.is_file():
        return []
    try:
        value = json.loads(config.read_text()).get("eos_token_id")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {config}: {exc}") from exc
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def hf_folder(source: ModelSourceLike | str | os.PathLike[str]) -> Path | None:
    """The Hugging Face folder a model source's tokenizer loads from; None for a GGUF file
    (whose tokenizer comes from its exported folder, with no processor)."""
    _, folder, gguf_name = _resolve(source)
    return folder if gguf_name is None else None


def load_tokenizer(source: ModelSourceLike | str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer of a Hugging Face model folder or a GGUF file.

    `source` is a `ModelSource` (or anything with name/path/format/gguf_file),
    or a plain path to a folder or a .gguf file. Nothing is fetched from a hub.
    """
    name, folder, gguf_name = _resolve(source)
    if gguf_name is not None:
        # transformers' GGUF reader imports torch: read the exported folder instead.
        folder = exported_folder(folder / gguf_name)
    from transformers import AutoTokenizer
    try:
        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {folder}: {exc}") from exc
    return Tokenizer(hf, name=name, extra_eos_token_ids=_generation_eos(folder))
