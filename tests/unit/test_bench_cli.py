"""`meshserve bench latency|throughput` and the transformers peer, end to end on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from meshserve.bench import engine as bench
from meshserve.cli.main import main as cli_main
from meshserve.services.worker.loader import load_model_config, resolve_model

ROOT = Path(__file__).resolve().parents[2]
# A small fixed KV cache: the CPU default would allocate 4 GiB.
ENGINE = ["--load-format", "dummy", "--device", "cpu", "--num-kv-blocks", "64", "--no-progress"]


def run_cli(args: list[str], tmp_path: Path, name: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert cli_main(["bench", *args, *ENGINE, "--output-json", str(out)]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def hf_parameter_counts(model_dir: Path) -> tuple[int, int]:
    """(all parameters, weights of the decoder layers' matrix products), counted by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    layer_matrices = sum(p.numel() for name, p in model.named_parameters()
                         if ".layers." in name and p.dim() == 2)
    return model.num_parameters(), layer_matrices


def test_latency_writes_consistent_figures(tiny_llama_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    r = run_cli(["latency", "--model", str(tiny_llama_dir), "--input-len", "12",
                 "--output-len", "6", "--batch-size", "2", "--num-iters", "3",
                 "--num-iters-warmup", "1"], tmp_path, "latency")
    assert "tpot" in capsys.readouterr().out
    assert (r["benchmark"], r["backend"]) == ("latency", "meshserve")
    assert r["config"]["input_len"] == 12 and r["config"]["batch_size"] == 2
    assert r["environment"]["torch"] == torch.__version__ and r["environment"]["device"] == "cpu"
    e2e, ttft = r["latencies_s"], r["ttfts_s"]
    assert len(e2e) == len(ttft) == 3
    assert all(0 < t < e for t, e in zip(ttft, e2e, strict=True))
    assert r["latency_s"]["avg"] == pytest.approx(statistics.mean(e2e))
    assert r["latency_s"]["p50"] == pytest.approx(statistics.median(e2e))
    assert min(e2e) <= r["latency_s"]["p50"] <= r["latency_s"]["p90"] <= r["latency_s"]["p99"]
    assert r["tpot_s"]["avg"] == pytest.approx(
        statistics.mean((e - t) / 5 for e, t in zip(e2e, ttft, strict=True)))
    num_params, _ = hf_parameter_counts(tiny_llama_dir)
    assert r["model"]["num_params"] == num_params
    assert r["weight_bytes"] == r["model"]["weight_bytes"] == 4 * num_params  # float32 on CPU
    assert r["copy_bandwidth_bytes_per_s"] > 0
    engine = r["environment"]["engine"]
    assert engine["kv_cache_blocks"] > 0 and engine["block_size"] == 16
    assert engine["cuda_graphs"] is None  # CPU: no graphs captured
    assert r["read_bytes"] == r["weight_bytes"]  # a dense model's token reads every weight
    assert r["floor_s_per_token"] == pytest.approx(r["read_bytes"]
                                                   / r["copy_bandwidth_bytes_per_s"])
    assert r["tpot_over_floor"] == pytest.approx(r["tpot_s"]["avg"] / r["floor_s_per_token"])
    assert r["prefill"]["tokens"] == 24
    assert r["prefill"]["flops_per_s"] == pytest.approx(r["prefill"]["flops"]
                                                        / r["ttft_s"]["avg"])


def test_the_floor_of_a_moe_model_counts_top_k_of_its_experts(tmp_path: Path) -> None:
    """A decode token reads k of E routed experts (and everything else): the latency floor's
    bytes, next to all the weight bytes."""
    from tiny_models import build_tiny_model

    from meshserve.bench.engine import decode_read_bytes
    from meshserve.services.worker.loader import ModelSource, load_model, load_model_config

    folder = build_tiny_model(tmp_path, "qwen3_moe")
    source = ModelSource(str(folder), folder, "hf", None)
    config = load_model_config(source)
    model = load_model(source, config, torch.float32, torch.device("cpu"), "auto")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    k, e = config.num_experts_per_tok, config.num_experts
    assert 0 < k < e and experts > 0
    assert decode_read_bytes(model, k) == 4 * (others + experts * k // e)
    dense = build_tiny_model(tmp_path / "dense", "llama")
    dense_source = ModelSource(str(dense), dense, "hf", None)
    dense_model = load_model(dense_source, load_model_config(dense_source), torch.float32,
                             torch.device("cpu"), "auto")
    assert decode_read_bytes(dense_model, 0) == 4 * sum(p.numel()
                                                        for p in dense_model.parameters())


def test_prefill_flops_match_a_count_of_the_model(tiny_llama_dir: Path) -> None:
    config = load_model_config(resolve_model(str(tiny_llama_dir), "dummy"))
    _, layer_matrices = hf_parameter_counts(tiny_llama_dir)
    s = 50
    # 2 FLOPs per weight per token; logits for the last position; QK^T and PV over the
    # causal pairs: 2 matmuls x 2 FLOPs x head_dim per (query head, pair), per layer.
    expected = (2 * layer_matrices * s + 2 * config.hidden_size * config.vocab_size
                + 2 * 2 * config.head_dim * config.num_attention_heads
                * config.num_hidden_layers * sum(range(1, s + 1)))
    assert bench.prefill_flops(config, s) == expected
    assert bench.prefill_flops(config, s, batch_size=3) == 3 * expected


def test_throughput_fixed_lengths(tiny_llama_dir: Path, tmp_path: Path) -> None:
    r = run_cli(["throughput", "--model", str(tiny_llama_dir), "--num-prompts", "5",
                 "--input-len", "10", "--output-len", "4", "--num-iters-warmup", "1"],
                tmp_path, "fixed")
    assert (r["benchmark"], r["num_requests"]) == ("throughput", 5)
    assert (r["input_tokens"], r["output_tokens"]) == (50, 20)
    assert r["elapsed_s"] > 0
    assert r["requests_per_s"] == pytest.approx(5 / r["elapsed_s"])
    assert r["output_tokens_per_s"] == pytest.approx(20 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(70 / r["elapsed_s"])
    assert r["num_preemptions"] == 0


def test_throughput_counts_preemptions_and_still_finishes_every_token(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    # 6 requests of 30 + 20 tokens need 4 blocks each at the end; 10 blocks hold two of them.
    out = tmp_path / "tight.json"
    assert cli_main(["bench", "throughput", "--model", str(tiny_llama_dir), "--load-format",
                     "dummy", "--device", "cpu", "--num-kv-blocks", "10", "--no-progress",
                     "--num-prompts", "6", "--input-len", "30", "--output-len", "20",
                     "--num-iters-warmup", "0", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 6 * 20
    assert r["num_preemptions"] > 0


def test_throughput_sharegpt_like(tiny_llama_dir: Path, tmp_path: Path) -> None:
    r = run_cli(["throughput", "--model", str(tiny_llama_dir), "--dataset", "sharegpt-like",
                 "--num-prompts", "6", "--max-model-len", "200", "--seed", "3",
                 "--num-iters-warmup", "0"], tmp_path, "sharegpt")
    lengths = bench.sharegpt_like_lengths(6, 3, 200)
    assert r["input_tokens"] == sum(i for i, _ in lengths)
    assert r["output_tokens"] == sum(o for _, o in lengths)
    assert r["config"]["dataset"] == "sharegpt-like"


def test_sharegpt_like_lengths_are_seeded_and_have_the_documented_shape() -> None:
    pairs = bench.sharegpt_like_lengths(4000, seed=7, max_model_len=100_000)
    assert pairs == bench.sharegpt_like_lengths(4000, seed=7, max_model_len=100_000)
    assert pairs != bench.sharegpt_like_lengths(4000, seed=8, max_model_len=100_000)
    inputs, outputs = [i for i, _ in pairs], [o for _, o in pairs]
    assert statistics.median(inputs) == pytest.approx(bench.SHAREGPT_INPUT_MEDIAN, rel=0.06)
    assert statistics.median(outputs) == pytest.approx(bench.SHAREGPT_OUTPUT_MEDIAN, rel=0.06)
    assert statistics.stdev(math.log(o) for o in outputs) == pytest.approx(
        bench.SHAREGPT_SIGMA, rel=0.08)
    assert min(inputs + outputs) >= bench.MIN_LEN and max(inputs + outputs) <= bench.MAX_LEN
    short = bench.sharegpt_like_lengths(500, seed=7, max_model_len=300)
    assert all(i + o <= 300 and i >= 1 and o >= 1 for i, o in short)


def test_random_prompts_are_seeded_uniform_and_avoid_special_ids(tiny_llama_dir: Path) -> None:
    config = load_model_config(resolve_model(str(tiny_llama_dir), "dummy"))
    special = set(config.eos_token_ids) | {config.bos_token_id} - {None}
    assert special
    prompts = bench.random_prompts([3, 20_000], config, seed=1)
    assert prompts == bench.random_prompts([3, 20_000], config, seed=1)
    assert [len(p) for p in prompts] == [3, 20_000]
    ids = prompts[1]
    assert not special & set(ids)
    assert all(0 <= t < config.vocab_size for t in ids)
    # ~45 draws per id: every allowed id shows up.
    assert len(set(ids)) == config.vocab_size - len(special)


def test_copy_bandwidth_on_cpu_is_a_rate() -> None:
    rate = bench.measure_copy_bandwidth("cpu", num_bytes=1 << 20, iters=3)
    assert math.isfinite(rate) and rate > 1e6


@pytest.mark.parametrize("args, param", [
    (["throughput", "--dataset", "sharegpt-like", "--input-len", "5"], "input_len"),
    (["throughput", "--input-len", "5"], "output_len"),
    (["latency", "--batch-size", "0"], "batch_size"),
    (["latency", "--num-iters-warmup", "-1"], "num_iters_warmup"),
])
def test_bad_flags_exit_2_naming_the_flag(args: list[str], param: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", *args]) == 2
    assert param in capsys.readouterr().err


def test_bench_without_a_known_benchmark_exits_2() -> None:
    assert cli_main(["bench"]) == 2
    assert cli_main(["bench", "bogus"]) == 2


# ----- the transformers peer ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_peer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_peer_bench",
                                                  ROOT / "loadtest" / "hf_peer_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_hf_peer_latency_has_the_shape_of_meshserve_bench(
        hf_peer: ModuleType, tiny_llama_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_llama_dir), "--device", "cpu", "--input-len", "12",
            "--output-len", "6", "--num-iters-warmup", "1", "--no-progress"]
    assert hf_peer.main(["latency", *args, "--batch-size", "2", "--num-iters", "3",
                         "--output-json", str(tmp_path / "hf.json")]) == 0
    hf = json.loads((tmp_path / "hf.json").read_text())
    ours = run_cli(["latency", "--model", str(tiny_llama_dir), "--input-len", "12",
                    "--output-len", "6", "--batch-size", "2", "--num-iters", "1",
                    "--num-iters-warmup", "0"], tmp_path, "ours")
    assert set(ours) - {"config"} <= set(hf)
    assert set(hf["latency_s"]) == set(ours["latency_s"]) and set(hf["prefill"]) == set(
        ours["prefill"])
    assert hf["backend"] == "transformers" and hf["model"]["dtype"] == "torch.float32"
    assert len(hf["latencies_s"]) == 3
    assert all(0 < t < e for t, e in zip(hf["ttfts_s"], hf["latencies_s"], strict=True))
    assert hf["weight_bytes"] == ours["weight_bytes"]
    assert hf["prefill"]["flops"] == ours["prefill"]["flops"]


def test_hf_peer_throughput_counts_requested_tokens(hf_peer: ModuleType, tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    assert hf_peer.main(["throughput", "--model", str(tiny_llama_dir), "--device", "cpu",
                         "--num-prompts", "5", "--input-len", "8", "--output-len", "4",
                         "--batch-sizes", "4,2", "--no-progress",
                         "--output-json", str(tmp_path / "t.json")]) == 0
    r = json.loads((tmp_path / "t.json").read_text())
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (5, 40, 20)
    assert r["batch_size"] == 4
    assert r["generated_tokens"] == 2 * 4 * 4  # two full batches of 4 rows (the last padded)
    assert r["output_tokens_per_s"] == pytest.approx(20 / r["elapsed_s"])


def test_hf_peer_falls_back_to_a_batch_size_that_fits(
        hf_peer: ModuleType, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peer = hf_peer.HfPeerBench(tiny_llama_dir, torch.device("cpu"), torch.float32, 0, False)
    original = peer.generate
    tried: list[int] = []

    def generate(prompts: list[list[int]], new_tokens: int, streamer: Any = None) -> None:
        tried.append(len(prompts))
        if len(prompts) > 2:
            raise torch.OutOfMemoryError("pretend the GPU is full")
        original(prompts, new_tokens, streamer)

    monkeypatch.setattr(peer, "generate", generate)
    args = hf_peer.parse_args(["throughput", "--model", str(tiny_llama_dir), "--num-prompts",
                               "6", "--input-len", "8", "--output-len", "3",
                               "--batch-sizes", "8,4,2,1", "--no-progress"])
    r = peer.throughput(args)
    assert r["batch_size"] == 2 and r["output_tokens"] == 18
    assert tried[:3] == [6, 4, 2]  # 8 capped to the 6 prompts, then down the list
