"""A short soak (loadtest/soak.py) in CI: 30 s of mixed load on two workers, two tokenizers
and two gateways (tiny model), with the scheduler, a gateway and a tokenizer killed in turn
(a worker's kill, the slowest restart, is tests/e2e/test_fault_matrix.py's).

No request is lost, answered 5xx, cut by an error event or left hanging (a killed gateway's
own requests may be cut: counted apart); bad inputs get their 4xx; every killed service is
back; the in-flight gauges are back to zero at the end; each process's RSS was sampled.
"""

from __future__ import annotations

import asyncio

import pytest
from loadtest_scripts import load_script

from meshserve.local.launcher import Stack, start_stack

soak = load_script("soak")
# Seed 25 draws the scheduler, gateway-0, then tokenizer-1 from the stack's kill targets.
OPTIONS = soak.SoakOptions(minutes=0.5, kill_every_s=8.0, concurrency=6, max_tokens=24,
                           long_prompt_tokens=512, request_timeout_s=60.0,
                           back_timeout_s=60.0, rss_every_s=2.0, seed=25)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    model = soak._tiny_model(tmp_path_factory.mktemp("soak-model"))
    config = soak.stack_config(model, OPTIONS, str(tmp_path_factory.mktemp("run")), tiny=True)
    with start_stack(config) as running:
        yield running


def test_a_short_soak_loses_nothing(stack: Stack) -> None:
    result = asyncio.run(soak.soak(stack, OPTIONS))
    outcomes = result["outcomes"]
    assert result["failures"] == [], [(f["kind"], f["outcome"], f["status"], f["detail"])
                                      for f in result["failures"][:5]]
    assert {k["part"] for k in result["kills"]} == {"scheduler", "gateway", "tokenizer"}, \
        result["kills"]
    assert result["every_kill_back"], result["kills"]
    assert all(result["restarts"][k["service"]] == 1 for k in result["kills"]), \
        result["restarts"]
    # Each kind ran and ended as it should.
    kinds = result["per_kind"]
    assert kinds["bad"].keys() <= {"rejected", "gateway_cut"} and kinds["bad"]["rejected"]
    assert kinds["cancel"].get("cancelled"), kinds
    for kind in ("stream", "chat", "long"):
        assert kinds[kind].keys() <= {"completed", "gateway_cut"}, kinds
        assert kinds[kind]["completed"], kinds
    assert outcomes.get("gateway_cut", 0) == len(result["gateway_cut"])
    assert result["gauges_zero"], result["gauges"]
    assert {"gateway-0", "gateway-1", "worker-0", "worker-1"} <= result["gauges"].keys()
    assert result["stack_up"] and result["ok"]
    assert {"worker-0", "worker-1", "tokenizer-1", "gateway-0", "redis"} <= result["rss"].keys()
    assert all(0 < rss["max"] <= rss["rss_max"] for rss in result["rss"].values())
    # The sampler followed each killed service to its new process.
    assert all(result["rss"][k["service"]]["pids"] == 2 for k in result["kills"]), result["rss"]
    assert soak.summary_markdown({**result, "model": "tiny", "cpu_count": 2,
                                  **vars(OPTIONS)}).startswith("# Soak: tiny")
