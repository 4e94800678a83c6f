"""loadtest/gateway_cost.py against a real gateway process: what the clients read adds up to
what the fake worker sent, and the cost figures are the CPU time over those tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from loadtest_scripts import load_script

gateway_cost = load_script("gateway_cost")


async def test_a_small_burst_reads_every_token_sent(tmp_path: Path) -> None:
    report = await gateway_cost.run([3], 5, 2, tmp_path, warmup=1)
    (burst,) = report["bursts"]
    # 3 streams of 5 tokens, 2 tokens a step: entries of 2, 2 and 1 tokens per stream.
    assert (burst["streams"], burst["tokens_per_stream"], burst["tokens_per_step"]) == (3, 5, 2)
    assert burst["tokens_sent"] == burst["tokens_read"] == burst["usage_tokens"] == 15
    assert burst["streams_done"] == 3
    assert burst["stream_steps"] == 9
    assert 3 <= burst["worker_steps"] <= 9
    cpu = burst["gateway_user_s"] + burst["gateway_sys_s"]
    assert burst["gateway_cpu_s"] == pytest.approx(cpu, abs=1e-3)
    assert burst["us_per_token"] == pytest.approx(cpu * 1e6 / 15, abs=0.01)
    assert burst["us_per_stream_step"] == pytest.approx(cpu * 1e6 / 9, abs=0.01)
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["python"]


def test_profile_shares_count_own_and_inclusive_time(tmp_path: Path) -> None:
    raw = tmp_path / "gateway.spy"
    repo = gateway_cost._REPO  # this checkout's root, wherever it is
    raw.write_text("run (a.py:1);write (site-packages/aiohttp/w.py:9) 6\n"
                   f"run (a.py:2);chunks ({repo}services/r.py:4) 3\n"
                   "run (a.py:1);write (site-packages/aiohttp/w.py:10) 1\n")
    samples = gateway_cost.read_samples(raw)
    assert sum(samples.values()) == 10
    own = {r["function"]: r["share"] for r in gateway_cost.top_shares(samples, leaf=True)}
    assert own == {"write (aiohttp/w.py)": 0.7, "chunks (services/r.py)": 0.3}
    inclusive = gateway_cost.top_shares(samples, leaf=False)
    assert inclusive[0] == {"function": "run (a.py)", "share": 1.0}
