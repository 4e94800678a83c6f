"""The requests of one benchmark, built from its config before anything is sent.

    workload = build_workload(config)     # ConfigError on bad input (exit 2)
    workload.requests, workload.warmup

Token-id prompts come from `datasets` exactly as `meshserve bench throughput` draws them;
text prompts are those ids decoded with the tokenizer (re-encoded and cut to the drawn length,
as vLLM's random dataset does; for prefix-heavy, each tenant's prefix decoded once and shared
as is) or a ShareGPT file's turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshserve.bench.serve import datasets, sharegpt
from meshserve.bench.serve.client import RequestInput
from meshserve.bench.serve.config import ServeConfig
from meshserve.shared.errors import ConfigError

# Outputs of warm-up requests are short: they only open connections and warm the server.
_WARMUP_OUTPUT_LEN = 16


@dataclass(frozen=True)
class Workload:
    """Timed requests, untimed warm-up requests, and the vocabulary the ids came from."""

    requests: list[RequestInput]
    warmup: list[RequestInput]
    vocabulary: datasets.Vocabulary | None


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face tokenizer from a local folder; ConfigError when there is none."""
    from transformers import AutoTokenizer  # only when asked for: it is slow to import

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer: {exc}",
                          param="tokenizer") from exc


def resolve_vocabulary(config: ServeConfig, tokenizer: Any) -> tuple[datasets.Vocabulary,
                                                                     int | None]:
    """(vocabulary, max_model_len): flags first, then --model-config, then the tokenizer.

    Text prompts never draw ids the tokenizer lacks or its special tokens (they would decode
    to control markers)."""
    facts = datasets.model_facts(config.model_config) if config.model_config else None
    size = config.vocab_size or (facts.vocabulary.size if facts else None)
    special = (frozenset(config.special_ids) if config.special_ids is not None
               else facts.vocabulary.special_ids if facts else None)
    if tokenizer is not None:
        size = size or len(tokenizer)
        if special is None:
            special = frozenset(tokenizer.all_special_ids)
        if config.resolved_prompt_format == "text":
            size = min(size, len(tokenizer))
            special |= frozenset(tokenizer.all_special_ids)
    if size is None:
        raise ConfigError("random token prompts need --model-config, --tokenizer or "
                          "--vocab-size", param="vocab_size")
    max_model_len = config.max_model_len or (facts.max_model_len if facts else None)
    return datasets.Vocabulary(size, special or frozenset()), max_model_len


def _token_prompts(config: ServeConfig, vocab: datasets.Vocabulary, max_model_len: int | None
                   ) -> list[tuple[list[int], int]]:
    """(prompt ids, output_len) of the random, ShareGPT-like and long-prompt datasets."""
    seed, n = config.seed, config.num_prompts
    if config.dataset == "long-prompt":
        lengths = datasets.long_prompt_lengths(n, *config.long_prompt_ranges, max_model_len,
                                               seed)
    elif config.dataset == "sharegpt-like":
        # No context length given: no cut (the mix never exceeds 2 x MAX_LEN tokens).
        lengths = datasets.sharegpt_like_lengths(n, seed, max_model_len or 2 * datasets.MAX_LEN)
    else:
        lengths = datasets.random_lengths(n, config.random_input_len, config.output_len,
                                          config.random_range_ratio, seed)
    prompts = datasets.random_prompts([i for i, _ in lengths], vocab.size, vocab.special_ids,
                                      seed)
    return [(p, out) for p, (_, out) in zip(prompts, lengths, strict=True)]


def prefix_heavy_set(config: ServeConfig, vocab: datasets.Vocabulary,
                     max_model_len: int | None) -> datasets.PrefixHeavy:
    """The prefix-heavy requests of `config`; ConfigError when one would not fit the
    context (the server would refuse every request)."""
    total = config.prefix_len + config.prefix_question_len + config.output_len
    if max_model_len is not None and total > max_model_len:
        raise ConfigError(f"prefix-heavy requests of {config.prefix_len} + "
                          f"{config.prefix_question_len} prompt and {config.output_len} output "
                          f"tokens exceed the context length {max_model_len}",
                          param="prefix_len")
    return datasets.prefix_heavy(
        config.num_prompts, num_tenants=config.prefix_tenants, prefix_len=config.prefix_len,
        zipf_s=config.prefix_zipf_s, question_len=config.prefix_question_len,
        output_len=config.output_len, vocabulary=vocab, seed=config.seed)


def _prefix_heavy_text(heavy: datasets.PrefixHeavy, tokenizer: Any) -> list[RequestInput]:
    """Text prompts that keep each tenant's prefix byte-identical: the prefix is decoded
    once per tenant and each question on its own, so every request of a tenant shares the
    prefix's tokens (up to the join); the length is the joined text's token count."""
    prefixes = [_as_text(p, tokenizer)[0] for p in heavy.prefixes]
    requests = []
    for tenant, question in zip(heavy.tenants, heavy.questions, strict=True):
        prompt = prefixes[tenant] + _as_text(question, tokenizer)[0]
        length = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(RequestInput(prompt, length, heavy.output_len))
    return requests


def _as_text(ids: list[int], tokenizer: Any) -> tuple[str, int]:
    """Text of about len(ids) tokens: decode, re-encode, cut, decode again (vLLM's way)."""
    text = tokenizer.decode(ids)
    again = tokenizer.encode(text, add_special_tokens=False)[: len(ids)]
    return tokenizer.decode(again), len(again)


def _requests(pairs: list[tuple[list[int], int]], tokenizer: Any, text: bool
              ) -> list[RequestInput]:
    if not text:
        return [RequestInput(ids, len(ids), out) for ids, out in pairs]
    return [RequestInput(*_as_text(ids, tokenizer), out) for ids, out in pairs]


def _sharegpt_requests(config: ServeConfig, tokenizer: Any) -> list[RequestInput]:
    assert config.dataset_path is not None
    samples = sharegpt.sample_sharegpt(sharegpt.read_conversations(config.dataset_path),
                                       config.num_prompts, config.seed, tokenizer,
                                       config.sharegpt_output_len)
    if config.resolved_prompt_format == "token-ids":
        return [RequestInput(s.prompt_ids, len(s.prompt_ids), s.output_len)
                for s in samples if s.prompt_ids is not None]
    return [RequestInput(s.prompt, len(s.prompt_ids) if s.prompt_ids is not None else None,
                         s.output_len) for s in samples]


def build_workload(config: ServeConfig) -> Workload:
    """Every request of the run; ConfigError when an input (file, tokenizer) is unusable."""
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    text = config.resolved_prompt_format == "text"
    count = min(config.num_warmup, config.num_prompts)
    if config.dataset == "sharegpt":
        requests = _sharegpt_requests(config, tokenizer)
        # The file's first prompts again, with short outputs.
        warmup = [RequestInput(r.prompt, r.prompt_len, min(r.output_len, _WARMUP_OUTPUT_LEN))
                  for r in requests[:count]]
        return Workload(requests, warmup, None)
    vocab, max_model_len = resolve_vocabulary(config, tokenizer)
    if config.dataset == "prefix-heavy":
        heavy = prefix_heavy_set(config, vocab, max_model_len)
        pairs = heavy.prompts()
        requests = _prefix_heavy_text(heavy, tokenizer) if text else _requests(pairs, None, False)
    else:
        pairs = _token_prompts(config, vocab, max_model_len)
        requests = _requests(pairs, tokenizer, text)
    # Warm-up prompts of the first lengths come from another seed (as in `bench throughput`),
    # so that they leave nothing of the timed prompts in a prefix cache.
    warm_ids = datasets.random_prompts([len(p) for p, _ in pairs[:count]], vocab.size,
                                       vocab.special_ids, config.seed + 1)
    warm = [(ids, min(out, _WARMUP_OUTPUT_LEN)) for ids, (_, out) in zip(warm_ids, pairs, strict=False)]
    return Workload(requests, _requests(warm, tokenizer, text), vocab)
