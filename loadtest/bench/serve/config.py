"""`ServeConfig`: the flags of `meshserve bench serve`, vLLM's names where vLLM has them.

A pure HTTP client's config: it does not inherit the engine's options. `--goodput` takes
vLLM's space-separated `KEY:VALUE` pairs (`--goodput ttft:500 tpot:50`); `normalize_argv`
joins them into the one comma-separated value the config pattern parses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from meshserve.shared.config import Config, option

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# Output tokens when --random-output-len is unset: vLLM's random default, and short answers
# for prefix-heavy, whose cost is meant to be the shared prompt.
_RANDOM_OUTPUT_LEN = 128
_PREFIX_HEAVY_OUTPUT_LEN = 64
_MULTI_VALUE_FLAGS = ("--goodput",)


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """`--goodput a b c` -> `--goodput a,b,c` (the values up to the next `-` argument)."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        out.append(arg)
        i += 1
        if arg in _MULTI_VALUE_FLAGS:
            values = []
            while i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            if values:  # none: argparse says the flag expects a value
                out.append(",".join(values))
    return out


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """SLOs in milliseconds by metric from `KEY:VALUE` items; ValueError when malformed."""
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"expected KEY:VALUE with KEY one of {list(GOODPUT_KEYS)}, "
                             f"got {item!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{key}: expected milliseconds, got {value!r}") from None
        if not (number >= 0 and math.isfinite(number)):
            raise ValueError(f"{key}: must be a finite number >= 0, got {value!r}")
        slos[key] = number
    return slos


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig(Config):
    """Benchmark an OpenAI-compatible server: streamed requests at a rate, latency figures."""

    base_url: str = option("http://127.0.0.1:8000", "server URL; /v1/... is appended")
    endpoint: Literal["completions", "chat"] = option(
        "completions", "completions: /v1/completions; chat: /v1/chat/completions")
    model: str | None = option(None, "model name to send (unset: the first of GET /v1/models)")
    api_key: str | None = option(None, "sent as `Authorization: Bearer KEY`")
    dataset: Literal["random", "sharegpt-like", "sharegpt", "prefix-heavy",
                     "long-prompt"] = option(
        "random", "random: --random-* lengths; sharegpt-like: the synthetic ShareGPT-like mix "
                  "of `meshserve bench throughput`; sharegpt: a ShareGPT JSON file "
                  "(--dataset-path); prefix-heavy: tenants' shared system prompts, each "
                  "request a Zipf-drawn tenant's prompt and its own question; long-prompt: "
                  "RAG-like long prompts and short answers (--long-prompt-*)")
    # option() returns a dataclasses.field (the default is None), not a shared mutable value.
    dataset_path: Path | None = option(None, "ShareGPT JSON file (--dataset sharegpt)")  # noqa: RUF009
    num_prompts: int = option(1000, "requests to send")
    random_input_len: int = option(1024, "prompt tokens (random dataset)")
    random_output_len: int | None = option(
        None, "output tokens of the random and prefix-heavy datasets (unset: 128 random, 64 "
              "prefix-heavy)")
    random_range_ratio: float = option(
        0.0, "lengths uniform in [len*(1-r), len*(1+r)] (random dataset)")
    prefix_tenants: int = option(32, "prefix-heavy: tenants, each with its own system prompt")
    prefix_len: int = option(2048, "prefix-heavy: tokens of each tenant's system prompt")
    prefix_zipf_s: float = option(
        1.1, "prefix-heavy: Zipf exponent of tenant popularity (rank k drawn with weight "
             "k^-s; 0: uniform)")
    prefix_question_len: int = option(
        32, "prefix-heavy: tokens of each request's own question after the system prompt")
    long_prompt_min_len: int = option(2048, "long-prompt: fewest prompt tokens")
    long_prompt_max_len: int = option(
        8192, "long-prompt: most prompt tokens (cut to the context length minus the longest "
              "answer)")
    long_prompt_min_output_len: int = option(64, "long-prompt: fewest output tokens")
    long_prompt_max_output_len: int = option(256, "long-prompt: most output tokens")
    sharegpt_output_len: int | None = option(
        None, "sharegpt: fixed output tokens (unset: the reply's token count, which needs "
              "--tokenizer)")
    prompt_format: Literal["auto", "token-ids", "text"] = option(
        "auto", "token-ids: send `prompt` as a list of ints (completions only); text: decode "
                "with --tokenizer; auto: text for chat and sharegpt, else token-ids")
    tokenizer: Path | None = option(None, "Hugging Face tokenizer folder (local files only)")  # noqa: RUF009
    model_config: Path | None = option(  # noqa: RUF009
        None, "model folder whose config.json gives vocab_size, eos/bos ids and context length")
    vocab_size: int | None = option(None, "ids are drawn from [0, N) (default: --model-config, "
                                          "else the tokenizer's size)")
    special_ids: tuple[int, ...] | None = option(
        None, "ids never drawn, comma-separated (default: --model-config's eos and bos ids, "
              "else the tokenizer's special ids)")
    max_model_len: int | None = option(
        None, "context length cutting the ShareGPT-like mix (default: --model-config's)")
    seed: int = option(0, "seed of the prompts and the arrival times")
    request_rate: float = option(math.inf, "requests per second (inf: all at once)")
    burstiness: float = option(
        1.0, "gamma shape of the inter-arrival times (1: Poisson; < 1 burstier)")
    max_concurrency: int | None = option(None, "most requests in flight (unset: no cap)")
    concurrency_sweep: tuple[int, ...] | None = option(
        None, "run once per max-concurrency value, e.g. 1,16,64,256")
    ignore_eos: bool = option(False, "send ignore_eos: true (vLLM extension)")
    temperature: float = option(0.0, "sampling temperature")
    goodput: tuple[str, ...] | None = option(
        None, "SLOs in ms, KEY:VALUE with KEY ttft, tpot or e2el (e.g. ttft:500 tpot:50)")
    percentile_metrics: tuple[str, ...] = option(
        ("ttft", "tpot", "itl"), "metrics given the --metric-percentiles, comma-separated, of "
        "ttft, tpot, itl, e2el (every metric has p90 and p99 in any case)")
    metric_percentiles: tuple[float, ...] = option(
        (99.0,), "percentiles of the --percentile-metrics, comma-separated (e.g. 25,50,99.9: "
                 "p25_ttft_ms, p50_ttft_ms, p99.9_ttft_ms, ...)")
    output_json: Path | None = option(None, "write the results as JSON here")  # noqa: RUF009
    plot: Path | None = option(None, "write a PNG of the latency CDFs here (needs matplotlib)")  # noqa: RUF009
    progress: bool = option(True, "show a progress bar on stderr")
    timeout_s: float = option(600.0, "seconds one request may take")
    num_warmup: int = option(1, "untimed requests before measuring")

    def validate(self) -> None:
        self.require(self.base_url.startswith(("http://", "https://")),
                     f"must start with http:// or https://, got {self.base_url!r}", "base_url")
        positive = ("num_prompts", "random_input_len", "prefix_tenants", "prefix_len",
                    "prefix_question_len", "long_prompt_min_len",
                    "long_prompt_min_output_len")
        for name in positive:
            value = getattr(self, name)
            self.require(value >= 1, f"must be >= 1, got {value}", name)
        for name in ("random_output_len", "sharegpt_output_len", "vocab_size", "max_model_len",
                     "max_concurrency"):
            value = getattr(self, name)
            self.require(value is None or value >= 1, f"must be >= 1, got {value}", name)
        for low, high in (("long_prompt_min_len", "long_prompt_max_len"),
                          ("long_prompt_min_output_len", "long_prompt_max_output_len")):
            self.require(getattr(self, high) >= getattr(self, low),
                         f"must be >= --{low.replace('_', '-')} ({getattr(self, low)}), "
                         f"got {getattr(self, high)}", high)
        self.require(0 <= self.random_range_ratio < 1,
                     f"must be in [0, 1), got {self.random_range_ratio}", "random_range_ratio")
        self.require(0 <= self.prefix_zipf_s < math.inf,
                     f"must be a finite number >= 0, got {self.prefix_zipf_s}", "prefix_zipf_s")
        self.require(self.request_rate > 0, f"must be > 0, got {self.request_rate}",
                     "request_rate")
        self.require(0 < self.burstiness < math.inf, f"must be > 0, got {self.burstiness}",
                     "burstiness")
        self.require(self.timeout_s > 0, f"must be > 0, got {self.timeout_s}", "timeout_s")
        self.require(self.num_warmup >= 0, f"must be >= 0, got {self.num_warmup}", "num_warmup")
        self.require(self.temperature >= 0, f"must be >= 0, got {self.temperature}",
                     "temperature")
        sweep = self.concurrency_sweep
        self.require(sweep is None or (len(sweep) > 0 and min(sweep) >= 1),
                     f"must be a comma-separated list of values >= 1, got {sweep}",
                     "concurrency_sweep")
        self.require(sweep is None or self.max_concurrency is None,
                     "give either --max-concurrency or --concurrency-sweep", "concurrency_sweep")
        unknown = sorted(set(self.percentile_metrics) - set(PERCENTILE_METRICS))
        self.require(not unknown, f"unknown metrics {unknown}: expected some of "
                                  f"{list(PERCENTILE_METRICS)}", "percentile_metrics")
        self.require(all(0 <= p <= 100 for p in self.metric_percentiles),
                     f"must be percentiles in [0, 100], got {self.metric_percentiles}",
                     "metric_percentiles")
        try:
            parse_goodput(self.goodput or ())
        except ValueError as exc:
            self.require(False, str(exc), "goodput")
        self._validate_prompts()

    def _validate_prompts(self) -> None:
        sharegpt = self.dataset == "sharegpt"
        self.require(not sharegpt or self.dataset_path is not None,
                     "is required with --dataset sharegpt", "dataset_path")
        self.require(sharegpt or self.dataset_path is None,
                     "is only for --dataset sharegpt", "dataset_path")
        self.require(not sharegpt or self.tokenizer is not None
                     or self.sharegpt_output_len is not None,
                     "--dataset sharegpt needs --tokenizer (reply lengths) or "
                     "--sharegpt-output-len", "sharegpt_output_len")
        fmt = self.resolved_prompt_format
        self.require(self.endpoint == "completions" or fmt == "text",
                     "the chat endpoint takes text prompts (--prompt-format text)",
                     "prompt_format")
        self.require(fmt == "token-ids" or sharegpt or self.tokenizer is not None,
                     "text prompts of a synthetic dataset need --tokenizer", "tokenizer")
        self.require(fmt == "text" or not sharegpt or self.tokenizer is not None,
                     "ShareGPT prompts as token ids need --tokenizer", "tokenizer")
        self.require(sharegpt or self.vocab_size is not None or self.model_config is not None
                     or self.tokenizer is not None,
                     "random token prompts need --model-config, --tokenizer or --vocab-size",
                     "vocab_size")

    @property
    def resolved_prompt_format(self) -> Literal["token-ids", "text"]:
        """The prompt format `auto` stands for: text for chat or sharegpt, else token ids."""
        if self.prompt_format != "auto":
            return self.prompt_format
        return "text" if self.endpoint == "chat" or self.dataset == "sharegpt" else "token-ids"

    @property
    def output_len(self) -> int:
        """Output tokens of a synthetic request: --random-output-len, else the dataset's."""
        if self.random_output_len is not None:
            return self.random_output_len
        return _PREFIX_HEAVY_OUTPUT_LEN if self.dataset == "prefix-heavy" else _RANDOM_OUTPUT_LEN

    @property
    def long_prompt_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The long-prompt set's (prompt, output) token ranges, both ends inclusive."""
        return ((self.long_prompt_min_len, self.long_prompt_max_len),
                (self.long_prompt_min_output_len, self.long_prompt_max_output_len))

    @property
    def goodput_slos_ms(self) -> dict[str, float]:
        """`--goodput` as {metric: milliseconds}."""
        return parse_goodput(self.goodput or ())

    @property
    def percentiles(self) -> dict[str, tuple[float, ...]]:
        """The --metric-percentiles of each of the --percentile-metrics."""
        return {metric: self.metric_percentiles for metric in self.percentile_metrics}

    @property
    def concurrencies(self) -> tuple[int | None, ...]:
        """The max-concurrency of every run: the sweep's values, or the one cap (None: none)."""
        return self.concurrency_sweep or (self.max_concurrency,)

    @property
    def url(self) -> str:
        """The endpoint's full URL."""
        path = "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"
        return self.base_url.rstrip("/") + path

    def as_report(self) -> dict[str, object]:
        """The config for the JSON report: the API key masked, paths and inf as strings."""
        values = self.as_dict()
        if values["api_key"] is not None:
            values["api_key"] = "***"
        return {k: (str(v) if isinstance(v, Path) or v == math.inf else v)
                for k, v in values.items()}
