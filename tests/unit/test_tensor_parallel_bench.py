"""`meshserve bench throughput --num-shards N --shard-index I`: engines in separate
processes (a TP=1 engine per GPU, beside one TP=2 engine) share one prompt list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshserve.bench.engine import ThroughputConfig
from meshserve.cli.main import main as cli_main
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.errors import ConfigError


def run_share(model: Path, out: Path, flags: list[str],
              monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The timed prompts a bench run fed its engine."""
    fed: list[list[int]] = []
    add_request = LLMEngine.add_request

    def recording(self: LLMEngine, request_id: str, prompt: list[int], *args: Any,
                  **kwargs: Any) -> None:
        if request_id.startswith("tput-"):
            fed.append(list(prompt))
        return add_request(self, request_id, prompt, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(LLMEngine, "add_request", recording)
        assert cli_main(["bench", "throughput", "--model", str(model), "--load-format",
                         "dummy", "--device", "cpu", "--num-kv-blocks", "64", "--no-progress",
                         "--dataset", "fixed", "--input-len", "6", "--output-len", "2",
                         "--num-prompts", "5", "--seed", "3", "--num-iters-warmup", "0",
                         "--output-json", str(out), *flags]) == 0
    return fed


def test_shares_split_the_prompt_list_round_robin(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = run_share(tiny_llama_dir, tmp_path / "all.json", [], monkeypatch)
    shares = [run_share(tiny_llama_dir, tmp_path / f"s{i}.json",
                        ["--num-shards", "2", "--shard-index", str(i)], monkeypatch)
              for i in (0, 1)]
    assert shares[0] == whole[0::2] and shares[1] == whole[1::2]
    reports = [json.loads((tmp_path / f"s{i}.json").read_text()) for i in (0, 1)]
    assert [r["num_requests"] for r in reports] == [3, 2]
    assert reports[0]["environment"]["engine"]["tensor_parallel_size"] == 1


@pytest.mark.parametrize(("shards", "index"), [(2, 2), (0, 0), (6, 0)])
def test_impossible_shares_are_refused(shards: int, index: int) -> None:
    with pytest.raises(ConfigError, match="shard"):
        ThroughputConfig(model="m", dataset="fixed", input_len=4, output_len=2, num_prompts=5,
                         num_shards=shards, shard_index=index)
