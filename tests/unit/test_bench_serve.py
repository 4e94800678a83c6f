"""`meshserve bench serve`'s pure parts: prompts, arrivals, SSE splitting, metrics, flags."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshserve.bench.serve import datasets, metrics, report, sharegpt
from meshserve.bench.serve.client import RequestResult, SseParser, error_message
from meshserve.bench.serve.config import ServeConfig, normalize_argv, parse_goodput
from meshserve.bench.serve.runner import arrival_offsets
from meshserve.bench.serve.workload import build_workload
from meshserve.shared.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


# ----- prompts ---------------------------------------------------------------------------
def test_random_prompts_are_seeded_split_from_one_draw_and_avoid_special_ids() -> None:
    prompts = datasets.random_prompts([3, 5, 20_000], 300, {0, 2, 299}, seed=4)
    assert prompts == datasets.random_prompts([3, 5, 20_000], 300, {0, 2, 299}, seed=4)
    assert prompts != datasets.random_prompts([3, 5, 20_000], 300, {0, 2, 299}, seed=5)
    assert [len(p) for p in prompts] == [3, 5, 20_000]
    # One flat draw split by the lengths: the same ids as one prompt of the total length.
    flat = datasets.random_prompts([20_008], 300, {0, 2, 299}, seed=4)[0]
    assert prompts[0] + prompts[1] + prompts[2] == flat
    assert set(flat) == set(range(300)) - {0, 2, 299}  # uniform: ~67 draws of each id


def test_random_prompts_are_numpys_generator_over_the_allowed_ids() -> None:
    allowed = np.array([i for i in range(50) if i not in (1, 7)])
    expected = allowed[np.random.default_rng(11).integers(len(allowed), size=9)].tolist()
    assert datasets.random_prompts([4, 5], 50, [7, 1], seed=11) == [expected[:4], expected[4:]]


def test_random_lengths_stay_within_the_range_ratio() -> None:
    pairs = datasets.random_lengths(2000, 100, 20, 0.5, seed=1)
    assert pairs == datasets.random_lengths(2000, 100, 20, 0.5, seed=1)
    inputs, outputs = [i for i, _ in pairs], [o for _, o in pairs]
    assert (min(inputs), max(inputs)) == (50, 150) and (min(outputs), max(outputs)) == (10, 30)
    assert datasets.random_lengths(5, 100, 20, 0.0, seed=1) == [(100, 20)] * 5


def test_sharegpt_like_prompts_are_those_of_bench_throughput(tiny_llama_dir: Path) -> None:
    from meshserve.bench import engine as bench
    from meshserve.services.worker.loader import load_model_config, resolve_model

    model_config = load_model_config(resolve_model(str(tiny_llama_dir), "dummy"))
    config = ServeConfig(dataset="sharegpt-like", model_config=tiny_llama_dir, num_prompts=40,
                         seed=9, num_warmup=3)
    workload = build_workload(config)
    # What bench_throughput draws: lengths cut to the engine's context, ids of those lengths.
    lengths = bench.sharegpt_like_lengths(40, 9, model_config.max_model_len)
    assert [r.prompt for r in workload.requests] == bench.random_prompts(
        [i for i, _ in lengths], model_config, 9)
    assert [(r.prompt_len, r.output_len) for r in workload.requests] == lengths
    special = {*model_config.eos_token_ids, model_config.bos_token_id} - {None}
    assert special and workload.vocabulary == datasets.Vocabulary(model_config.vocab_size,
                                                                  frozenset(special))
    warm = bench.random_prompts([i for i, _ in lengths[:3]], model_config, 10)
    assert [r.prompt for r in workload.warmup] == warm


def test_text_prompts_decode_the_ids_with_the_tokenizer(tmp_path: Path) -> None:
    from tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    config = ServeConfig(dataset="random", tokenizer=tmp_path, prompt_format="text",
                         num_prompts=5, random_input_len=30, random_output_len=4, num_warmup=0)
    requests = build_workload(config).requests
    assert all(isinstance(r.prompt, str) and r.prompt for r in requests)
    for r in requests:
        assert r.prompt_len is not None and 0 < r.prompt_len <= 30
        assert r.output_len == 4


# ----- ShareGPT files --------------------------------------------------------------------
class WordEncoder:
    """One token per word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


def _turns(*pairs: tuple[str, str]) -> dict[str, object]:
    return {"conversations": [{"from": who, "value": text} for who, text in pairs]}


def write_sharegpt(path: Path) -> Path:
    entries = [
        _turns(("human", "one two three four five"), ("gpt", "a b c d e f")),
        _turns(("system", "be nice"), ("user", "six seven eight nine"),
               ("assistant", "g h i j")),
        _turns(("gpt", "reply first"), ("human", "tiny")),  # no reply after the human turn
        {"id": "no conversations"},
        _turns(("human", "x y"), ("gpt", "too short a prompt for the filter")),
        _turns(("human", "p q r s t u v"), ("gpt", "k l")),  # reply under 4 tokens
    ]
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_file_parsing_takes_the_first_human_turn_and_its_reply(tmp_path: Path) -> None:
    found = sharegpt.read_conversations(write_sharegpt(tmp_path / "sg.json"))
    assert [(c.prompt, c.reply) for c in found] == [
        ("one two three four five", "a b c d e f"), ("six seven eight nine", "g h i j"),
        ("x y", "too short a prompt for the filter"), ("p q r s t u v", "k l")]


def test_sharegpt_sampling_filters_shuffles_with_the_seed_and_cycles(tmp_path: Path) -> None:
    found = sharegpt.read_conversations(write_sharegpt(tmp_path / "sg.json"))
    samples = sharegpt.sample_sharegpt(found, 5, seed=1, tokenizer=WordEncoder(),
                                       output_len=None)
    assert samples == sharegpt.sample_sharegpt(found, 5, seed=1, tokenizer=WordEncoder(),
                                               output_len=None)
    kept = {("one two three four five", 6), ("six seven eight nine", 4)}
    assert {(s.prompt, s.output_len) for s in samples} == kept  # the filter drops two
    assert len(samples) == 5 and samples[2:4] == samples[:2]  # cycled to the count
    assert all(s.prompt_ids == WordEncoder().encode(s.prompt) for s in samples)
    fixed = sharegpt.sample_sharegpt(found, 3, seed=1, tokenizer=WordEncoder(), output_len=9)
    assert {s.output_len for s in fixed} == {9}
    plain = sharegpt.sample_sharegpt(found, 4, seed=1, tokenizer=None, output_len=7)
    assert sorted(s.prompt for s in plain) == sorted(c.prompt for c in found)
    assert all(s.prompt_ids is None for s in plain)


@pytest.mark.parametrize("content, words", [
    (b"{not json", "not JSON"), (b'{"a": 1}', "expected a JSON list"),
    (b'[{"conversations": []}]', "none of its 1 entries")])
def test_bad_sharegpt_files_are_config_errors(tmp_path: Path, content: bytes,
                                              words: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        sharegpt.read_conversations(path)
    with pytest.raises(ConfigError, match="cannot read"):
        sharegpt.read_conversations(tmp_path / "missing.json")


# ----- arrivals --------------------------------------------------------------------------
def test_gamma_arrivals_have_mean_gap_one_over_rate_and_burstiness_sets_the_spread() -> None:
    n, rate = 50_000, 20.0
    spreads = {}
    for burstiness in (0.25, 1.0, 4.0):
        offsets = arrival_offsets(n, rate, burstiness, seed=0)
        assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
        gaps = np.diff(offsets)
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
        # gamma(k, 1/(rate k)): variance 1 / (k rate^2), coefficient of variation 1/sqrt(k)
        spreads[burstiness] = gaps.std() / gaps.mean()
        assert spreads[burstiness] == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert spreads[0.25] > spreads[1.0] > spreads[4.0]
    assert np.array_equal(arrival_offsets(10, rate, 1.0, seed=3),
                          arrival_offsets(10, rate, 1.0, seed=3))
    assert not np.any(arrival_offsets(7, math.inf, 1.0, seed=0))


# ----- SSE splitting ---------------------------------------------------------------------
STREAM = (b'data: {"a": 1}\n\n: a comment\n\ndata: {"b": 2}\r\n\r\n'
          b'event: x\ndata: line one\ndata: line two\n\ndata: [DONE]\n\n')
EVENTS = [b'{"a": 1}', b'{"b": 2}', b"line one\nline two", b"[DONE]"]


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_sse_parser_gives_the_same_events_wherever_the_bytes_are_cut(cut: int) -> None:
    parser = SseParser()
    assert parser.feed(STREAM[:cut]) + parser.feed(STREAM[cut:]) == EVENTS


def test_sse_parser_byte_by_byte_and_an_unterminated_last_event() -> None:
    parser = SseParser()
    events = [e for i in range(len(STREAM)) for e in parser.feed(STREAM[i : i + 1])]
    assert events == EVENTS
    parser = SseParser()
    assert parser.feed(b"data: [DONE]") == [] and parser.finish() == [b"[DONE]"]


def test_error_bodies_give_their_message() -> None:
    assert error_message(b'{"error": {"message": "too many", "code": 429}}') == "too many"
    assert error_message(b'{"error": "plain"}') == "plain"
    assert error_message(b"Bad Gateway\n") == "Bad Gateway"


# ----- metrics ---------------------------------------------------------------------------
def test_distribution_percentiles_by_hand() -> None:
    d = metrics.distribution("ttft", [0.004, 0.001, 0.003, 0.002])  # seconds
    assert d["mean_ttft_ms"] == pytest.approx(2.5)
    assert d["median_ttft_ms"] == pytest.approx(2.5)
    assert d["p90_ttft_ms"] == pytest.approx(3.7)  # rank 0.9 x 3 = 2.7: 3 + 0.7
    assert d["p99_ttft_ms"] == pytest.approx(3.97)
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt(1.25))
    assert set(metrics.distribution("itl", [])) == {
        "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p90_itl_ms", "p99_itl_ms"}


def out(ttft: float, latency: float, tokens: int, prompt: int = 10, ok: bool = True,
        status: int | None = 200, error: str = "") -> RequestResult:
    return RequestResult(success=ok, status=status, error=error, prompt_len=prompt,
                         output_tokens=tokens, ttft=ttft, latency=latency,
                         itl=[(latency - ttft) / max(tokens - 1, 1)] * (tokens - 1))


def test_goodput_and_run_result_by_hand() -> None:
    outputs = [
        out(0.1, 1.1, 11),   # tpot 100 ms
        out(0.3, 0.8, 6),    # ttft 300 ms, tpot 100 ms
        out(0.1, 0.5, 1),    # one token: tpot 0
        out(0.2, 2.2, 5),    # tpot 500 ms, e2e 2200 ms
        out(0, 0, 0, ok=False, status=429, error="busy"),
        out(0, 0, 0, ok=False, status=None, error="refused"),
        out(0, 0, 0, ok=False, status=429, error="busy"),
    ]
    slos = {"ttft": 200.0, "tpot": 100.0}
    assert [metrics.is_good(o, slos) for o in outputs[:4]] == [True, False, True, False]
    assert metrics.is_good(outputs[3], {"e2el": 2200.0})  # at the SLO counts as met
    r = metrics.run_result(outputs, 2.0, slos)
    assert (r["completed"], r["failed"]) == (4, 3)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (40, 23)
    assert r["request_throughput"] == 2.0 and r["request_goodput"] == 1.0
    assert r["output_throughput"] == 11.5 and r["total_token_throughput"] == 31.5
    assert r["mean_ttft_ms"] == pytest.approx(175.0)
    assert r["mean_tpot_ms"] == pytest.approx(700 / 3)  # one-token requests have no TPOT
    assert r["mean_e2el_ms"] == pytest.approx(1150.0)
    assert r["failures"] == {"count": 3, "by_status": {"429": 2, "no response": 1},
                             "by_error": {"busy": 2, "refused": 1}}
    assert r["output_lens"] == [11, 6, 1, 5, 0, 0, 0]
    assert r["errors"][4:] == ["busy", "refused", "busy"] and r["itls"][4] == []
    assert metrics.run_result(outputs, 2.0)["request_goodput"] is None


def test_metric_percentiles_are_added_under_vllms_names() -> None:
    assert metrics.percentile_key("itl", 99.9) == "p99.9_itl_ms"
    assert metrics.percentile_key("ttft", 25.0) == "p25_ttft_ms"
    values_s = [i / 1000 for i in range(1, 101)]  # 1 .. 100 ms
    d = metrics.distribution("itl", values_s, (25.0, 99.9))
    assert d["p25_itl_ms"] == pytest.approx(25.75)  # rank 0.25 x 99 = 24.75: 25 + 0.75
    assert d["p99.9_itl_ms"] == pytest.approx(99.901)
    assert d["p90_itl_ms"] == pytest.approx(90.1) and d["p99_itl_ms"] == pytest.approx(99.01)
    assert metrics.distribution("itl", [], (25.0,))["p25_itl_ms"] == 0.0
    config = ServeConfig.from_args(["--vocab-size", "9", "--percentile-metrics", "ttft,itl",
                                    "--metric-percentiles", "25,99.9"], environ={})
    assert config.percentiles == {"ttft": (25.0, 99.9), "itl": (25.0, 99.9)}
    r = metrics.run_result([out(0.1, 1.1, 11), out(0.3, 0.8, 6)], 2.0,
                           percentiles=config.percentiles)
    assert r["p25_ttft_ms"] == pytest.approx(150.0) and "p99.9_itl_ms" in r
    assert "p25_tpot_ms" not in r and "p25_e2el_ms" not in r
    block = report.result_block({**r, "max_concurrency": None})
    ttft_rows = [line.split(":")[0] for line in block.splitlines() if " TTFT (ms)" in line]
    assert ttft_rows == ["Mean TTFT (ms)", "Median TTFT (ms)", "P25 TTFT (ms)",
                         "P90 TTFT (ms)", "P99 TTFT (ms)", "P99.9 TTFT (ms)"]
    assert "P25 TPOT (ms)" not in block and "P99 TPOT (ms)" in block


# ----- flags -----------------------------------------------------------------------------
def test_goodput_flag_takes_vllms_space_separated_pairs() -> None:
    argv = normalize_argv(["--goodput", "ttft:500", "tpot:50", "--num-prompts", "3"])
    assert argv == ["--goodput", "ttft:500,tpot:50", "--num-prompts", "3"]
    config = ServeConfig.from_args([*argv, "--vocab-size", "10"], environ={})
    assert config.goodput_slos_ms == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ConfigError, match="expected one argument"):
        ServeConfig.from_args(normalize_argv(["--vocab-size", "9", "--goodput"]), environ={})
    with pytest.raises(ValueError, match="KEY one of"):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError, match=">= 0"):
        parse_goodput(["ttft:-1"])


@pytest.mark.parametrize("argv, param", [
    (["--dataset", "sharegpt"], "dataset_path"),
    (["--endpoint", "chat", "--vocab-size", "9"], "tokenizer"),
    (["--endpoint", "chat", "--prompt-format", "token-ids", "--vocab-size", "9"],
     "prompt_format"),
    ([], "vocab_size"),
    (["--vocab-size", "9", "--random-range-ratio", "1"], "random_range_ratio"),
    (["--vocab-size", "9", "--max-concurrency", "2", "--concurrency-sweep", "1,2"],
     "concurrency_sweep"),
    (["--vocab-size", "9", "--goodput", "ttfb:3"], "goodput"),
    (["--vocab-size", "9", "--base-url", "localhost:8000"], "base_url"),
    (["--vocab-size", "9", "--request-rate", "0"], "request_rate"),
    (["--vocab-size", "9", "--percentile-metrics", "ttft,latency"], "percentile_metrics"),
    (["--vocab-size", "9", "--metric-percentiles", "50,101"], "metric_percentiles"),
])
def test_bad_flags_are_config_errors_naming_the_field(argv: list[str], param: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeConfig.from_args(normalize_argv(argv), environ={})
    assert caught.value.param == param


def test_the_package_and_its_flag_parsing_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from meshserve.cli.main import main\n"
        "from meshserve.bench.serve import cli, plot, report, runner\n"
        "from meshserve.bench.serve.config import ServeConfig\n"
        "from meshserve.bench.serve.workload import build_workload\n"
        "c = ServeConfig.from_args(['--vocab-size', '100', '--num-prompts', '3'], strict_env=False)\n"
        "build_workload(c)\n"
        "assert main(['bench', 'serve', '--num-prompts', '0']) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert "meshserve bench serve: " in done.stderr
