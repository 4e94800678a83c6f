"""Prompts from a ShareGPT JSON file, sampled as vLLM's `--dataset-name sharegpt` does.

The file is the usual list of `{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`. Each conversation gives one request: its first human
turn is the prompt and the gpt turn after it the reference reply. The conversations are
shuffled with the seed (`random.Random(seed)`); with a tokenizer, pairs whose prompt or reply
has fewer than 4 tokens, whose prompt has more than 1024 or whose total exceeds 2048 are
skipped (vLLM's filter), and the output length is the reply's token count unless a fixed one
is given.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from meshserve.shared.errors import ConfigError

_HUMAN = frozenset({"human", "user"})
_GPT = frozenset({"gpt", "assistant", "chatgpt", "bard", "model"})
MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


class Encoder(Protocol):
    """The part of a Hugging Face tokenizer that ShareGPT sampling uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Conversation:
    """A prompt and its reference reply."""

    prompt: str
    reply: str


@dataclass(frozen=True)
class TextSample:
    """One request drawn from the file: prompt text, its token ids and count when a tokenizer
    gave them (else None), and the output length to ask for."""

    prompt: str
    prompt_ids: list[int] | None
    output_len: int


def _first_exchange(entry: Any) -> Conversation | None:
    """The first human turn and the gpt turn right after it, or None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, after in itertools.pairwise(turns):
        if not (isinstance(turn, dict) and isinstance(after, dict)):
            continue
        if turn.get("from") in _HUMAN and after.get("from") in _GPT:
            prompt, reply = turn.get("value"), after.get("value")
            if isinstance(prompt, str) and isinstance(reply, str) and prompt:
                return Conversation(prompt, reply)
    return None


def read_conversations(path: Path) -> list[Conversation]:
    """Every usable (first human turn, reply) of a ShareGPT file; ConfigError naming the
    file when it is not one."""
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"--dataset-path {path}: cannot read: {exc.strerror or exc}",
                          param="dataset_path") from exc
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"--dataset-path {path}: not JSON: {exc}",
                          param="dataset_path") from exc
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {path}: expected a JSON list of conversations, "
                          f"got {type(data).__name__}", param="dataset_path")
    found = [c for c in map(_first_exchange, data) if c is not None]
    if not found:
        raise ConfigError(f"--dataset-path {path}: none of its {len(data)} entries has a "
                          f"'conversations' list with a human turn followed by a gpt turn",
                          param="dataset_path")
    return found


def sample_sharegpt(conversations: list[Conversation], num_prompts: int, seed: int,
                    tokenizer: Encoder | None, output_len: int | None) -> list[TextSample]:
    """`num_prompts` samples from the shuffled conversations (cycling when the filter leaves
    fewer); without a tokenizer `output_len` is required and nothing is filtered."""
    assert tokenizer is not None or output_len is not None, \
        "ShareGPT without a tokenizer needs a fixed output length"
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    samples: list[TextSample] = []
    for index in order:
        if len(samples) == num_prompts:
            break
        sample = _sample(conversations[index], tokenizer, output_len)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise ConfigError(f"no ShareGPT conversation passes the length filter (prompt and "
                          f"reply >= {MIN_TOKENS} tokens, prompt <= {MAX_PROMPT_TOKENS}, "
                          f"total <= {MAX_TOTAL_TOKENS})", param="dataset_path")
    while len(samples) < num_prompts:
        samples.extend(samples[: num_prompts - len(samples)])
    return samples


def _sample(conversation: Conversation, tokenizer: Encoder | None, output_len: int | None
            ) -> TextSample | None:
    if tokenizer is None:
        assert output_len is not None
        return TextSample(conversation.prompt, None, output_len)
    prompt_ids = tokenizer.encode(conversation.prompt)
    reply_len = len(tokenizer.encode(conversation.reply))
    wanted = output_len if output_len is not None else reply_len
    too_short = len(prompt_ids) < MIN_TOKENS or (output_len is None and reply_len < MIN_TOKENS)
    too_long = (len(prompt_ids) > MAX_PROMPT_TOKENS
                or len(prompt_ids) + wanted > MAX_TOTAL_TOKENS)
    if too_short or too_long:
        return None
    return TextSample(conversation.prompt, prompt_ids, wanted)
