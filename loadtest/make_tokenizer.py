"""A byte-level BPE tokenizer of a model config's exact vocabulary size, built offline.

Driver part: `mesh`, `kv`, `tp`, `structured`, `metrics`, `fp8` (FP8_RUNS=mesh).

Benchmarks run Llama-3.1-8B-shaped models with random weights (`--load-format dummy`) from
a folder that holds only config.json (loadtest/models/llama-3.1-8b). Serving such a model
through the mesh needs a tokenizer whose vocabulary has exactly `vocab_size` tokens, so that
the gateway can detokenize every id the model samples. No model hub is reachable, so this
script makes one, deterministically and in about a second:

- ids 0..255: the 256 byte-level symbols (GPT-2's byte-to-unicode mapping), id = byte value;
- the config's bos/eos ids: special tokens named as in Llama 3 (`<|begin_of_text|>`; the eos
  ids in order `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`, further ones
  `<|reserved_special_token_N|>`);
- the two highest free ids: `<|start_header_id|>` and `<|end_header_id|>` for the chat
  template (Llama 3 has them at 128006/128007; a random-weight model needs only stable ids);
- every other id: a merge of two existing tokens, frequent-looking ones first (letters,
  space + letters, digit pairs, then longer letter runs), until the vocabulary is full.

Text is pre-split with Llama 3's regex; every id decodes to text (a lone byte of a multi-byte
character decodes to U+FFFD, as with any byte-level tokenizer). The tokenizer's eos token is
the config's last eos id (`<|eot_id|>` for Llama 3.1, the end of a chat turn, as in
Llama-3.1-Instruct); generation_config.json lists every eos id.

    python loadtest/make_tokenizer.py --config loadtest/models/llama-3.1-8b/config.json \\
        --out /tmp/llama8b

writes config.json (copied), generation_config.json and the tokenizer files into --out, so
that the repository's model folder stays config-only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

DEFAULT_CONFIG = Path(__file__).resolve().parent / "models" / "llama-3.1-8b" / "config.json"
BOS_NAME = "<|begin_of_text|>"
EOS_NAMES = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
HEADER_NAMES = ("<|start_header_id|>", "<|end_header_id|>")
# Llama 3's pre-tokenizer split: contractions, letter runs, up to 3 digits, punctuation, spaces.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Letters by English frequency: the most common combinations get the lowest merge ranks.
LOWER = "etaoinshrdlcumwfgypbvkjxqz"
UPPER = LOWER.upper()
DIGITS = "0123456789"
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '" + "{eot}" + "' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@dataclass(frozen=True)
class Specials:
    """Special token names by id, and which of them are bos, eos (of the tokenizer), eot."""

    names: dict[int, str]
    bos: str | None
    eos: str | None

    @classmethod
    def of_config(cls, config: dict[str, object]) -> Specials:
        vocab_size = _int(config.get("vocab_size"), "vocab_size")
        bos_id = config.get("bos_token_id")
        eos = config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else []
        names: dict[int, str] = {}
        if bos_id is not None:
            names[_int(bos_id, "bos_token_id")] = BOS_NAME
        for i, token_id in enumerate(eos_ids):
            name = EOS_NAMES[i] if i < len(EOS_NAMES) else f"<|reserved_special_token_{i}|>"
            names.setdefault(_int(token_id, "eos_token_id"), name)
        out_of_range = sorted(i for i in names if not 0 <= i < vocab_size)
        if out_of_range:
            raise ValueError(f"special ids {out_of_range} are outside vocab_size {vocab_size}")
        free = (i for i in range(vocab_size - 1, -1, -1) if i not in names)
        for name in HEADER_NAMES:
            names[next(free)] = name
        eos_name = names[eos_ids[-1]] if eos_ids else None
        return cls(names, names.get(bos_id) if isinstance(bos_id, int) else None, eos_name)


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"config {what} must be an integer, got {value!r}")
    return value


def merge_candidates() -> Iterator[tuple[str, str]]:
    """(left, right) pairs of byte-level strings, likely text first, each left an earlier
    result (or a single symbol): two characters, then letter runs one longer per round."""
    space, newline = "Ġ", "Ċ"
    yield from ((space, c) for c in LOWER + UPPER)
    yield from ((a, b) for a in LOWER + UPPER for b in LOWER)
    yield from ((a, b) for a in DIGITS for b in DIGITS)
    yield from ((a, b) for a in (newline, space) for b in (newline, space))
    yield from ((a, b) for a in ".,:;!?" for b in (space, newline))
    length = 3
    while True:  # every word of this length, one letter longer than the last round's
        yield from ((word[:-1], word[-1]) for word in _words(length))
        length += 1


def _words(length: int) -> Iterator[str]:
    """Letter runs of `length` (>= 2) byte-level characters, optionally after a space."""
    if length == 2:
        yield from ("Ġ" + c for c in LOWER + UPPER)
        yield from (a + b for a in LOWER + UPPER for b in LOWER)
        return
    for word in _words(length - 1):
        yield from (word + c for c in LOWER)


def build_vocab(vocab_size: int, specials: Specials) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary (token -> id, exactly `vocab_size` entries) and its merges."""
    plain_ids = [i for i in range(vocab_size) if i not in specials.names]
    symbols = bytes_to_unicode()
    if len(plain_ids) < len(symbols):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the 256 byte symbols")
    vocab = {name: token_id for token_id, name in specials.names.items()}
    ids = iter(plain_ids)
    for byte in range(256):
        vocab[symbols[byte]] = next(ids)
    merges: list[tuple[str, str]] = []
    remaining = len(plain_ids) - 256
    candidates = merge_candidates()
    while len(merges) < remaining:
        left, right = next(candidates)
        token = left + right
        if token in vocab:
            continue
        assert left in vocab and right in vocab, f"merge ({left!r}, {right!r}) of unknown tokens"
        vocab[token] = next(ids)
        merges.append((left, right))
    assert len(vocab) == vocab_size, f"built {len(vocab)} tokens, wanted {vocab_size}"
    return vocab, merges


def build_tokenizer(config: dict[str, object]) -> PreTrainedTokenizerFast:
    """The tokenizer of `config` (a model's config.json as a dict)."""
    vocab_size = _int(config.get("vocab_size"), "vocab_size")
    specials = Specials.of_config(config)
    vocab, merges = build_vocab(vocab_size, specials)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    # Added tokens already in the model's vocabulary keep their ids there: the config's ids.
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False)
                                for _, name in sorted(specials.names.items())])
    if specials.bos is not None:
        bos = (specials.bos, vocab[specials.bos])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{specials.bos} $A", pair=f"{specials.bos} $A {specials.bos} $B:1",
            special_tokens=[bos])
    end_of_turn = specials.eos or ""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=specials.bos, eos_token=specials.eos,
        chat_template=CHAT_TEMPLATE.replace("{eot}", end_of_turn), model_max_length=_max_length(config),
        clean_up_tokenization_spaces=False)


def _max_length(config: dict[str, object]) -> int:
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else 131072


def make_model_folder(config_path: Path, out: Path) -> PreTrainedTokenizerFast:
    """Write config.json (copied), generation_config.json and the tokenizer into `out`."""
    config = json.loads(config_path.read_text())
    tokenizer = build_tokenizer(config)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "config.json").exists() or not (out / "config.json").samefile(config_path):
        shutil.copyfile(config_path, out / "config.json")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    # transformers 5 writes its own class name; the generic fast class loads on 4.x and 5.x.
    settings_path = out / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings_path.write_text(json.dumps(settings, indent=2) + "\n")
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help=f"the model's config.json (default: {DEFAULT_CONFIG})")
    parser.add_argument("--out", type=Path, required=True,
                        help="model folder to write (config.json is copied into it)")
    args = parser.parse_args(argv)
    tokenizer = make_model_folder(args.config, args.out)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out} "
          f"(bos {tokenizer.bos_token}, eos {tokenizer.eos_token})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
