"""The KV tier and routing end to end, on `meshserve up` stacks of two workers (CPU, tiny
model, the real `openai` client).

- A prompt computed on one worker and evicted there is loaded from the kvstore by the
  other worker (the workers' and the store's counters say so), with the same output as
  when it was computed.
- On the same prefix-heavy requests, the kv-aware policy reports strictly more cached
  prompt tokens (usage.prompt_tokens_details.cached_tokens) than round-robin.
"""

from __future__ import annotations

import random
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

MODEL = "tiny"
BLOCK = 16
KV_BLOCKS = 48  # per worker: a few prompts' worth, so that others evict a prompt


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tier-model"), "llama", seed=21,
                            max_position_embeddings=2048)


def launch(model_dir: Path, run_dir: Path, **overrides: object) -> Iterator[Stack]:
    config = LauncherConfig(**{  # type: ignore[arg-type]
        "model": str(model_dir), "served_model_name": MODEL, "workers": 2, "port": 0,
        "num_kv_blocks": KV_BLOCKS, "block_size": BLOCK, "dtype": "float32", "device": "cpu",
        "run_dir": str(run_dir), "startup_timeout_s": 300, "stop_grace_s": 5, **overrides})
    with start_stack(config) as running:
        yield running


def metric(url: str, name: str) -> float:
    """The value of an unlabelled metric on a Prometheus endpoint (0 when absent)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def per_service(stack: Stack, role: str, name: str) -> dict[str, float]:
    return {s.name: metric(s.metrics_url, name) for s in stack.services if s.role == role}


def wait_saved(stack: Stack, before: dict[str, float], blocks: int,
               timeout_s: float = 60.0) -> dict[str, float]:
    """The workers' saved-block counters once one of them has saved `blocks` more than
    `before` (workers save after the response, on their transfer threads: there is no
    event to wait on but the counters)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = per_service(stack, "worker", "meshserve:worker_kvstore_saved_blocks_total")
        if any(now[w] - before[w] >= blocks for w in now):
            return now
        assert time.monotonic() < deadline, f"saves never arrived: {before} -> {now}"
        time.sleep(0.05)  # polling the counters, which change on their own


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int = 12
             ) -> tuple[str, int]:
    """Greedy completion of a token prompt: its text and its cached prompt tokens."""
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True})
    assert response.usage is not None
    assert response.usage.completion_tokens == max_tokens
    details = response.usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return response.choices[0].text, cached


def random_prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(5, 250) for _ in range(blocks * BLOCK + 3)]


def test_a_prompt_evicted_on_one_worker_is_loaded_from_the_store_by_the_other(
        model_dir: Path, tmp_path: Path) -> None:
    for stack in launch(model_dir, tmp_path / "run", routing="round-robin"):
        client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none")
        rng = random.Random(0)
        target = random_prompt(rng, 10)
        saved = per_service(stack, "worker", "meshserve:worker_kvstore_saved_blocks_total")
        computed, cached = complete(client, target)
        assert cached == 0
        # The target's full prompt blocks reach the store after the response: wait for them.
        after = wait_saved(stack, saved, (len(target) - 1) // BLOCK)
        (computer,) = [w for w in after if after[w] > saved[w]]
        # Round-robin: fillers alternate, and an even number of them sends the target
        # to the other worker; each worker computes 8 x 11 blocks of fillers, which evicts
        # every block of the target from its 48-block cache.
        for _ in range(16):
            complete(client, random_prompt(rng, 10), max_tokens=2)
        loaded = per_service(stack, "worker", "meshserve:worker_kvstore_loaded_blocks_total")
        store_url = stack_service(stack, "kvstore").metrics_url
        hits = metric(store_url, "meshserve:kvstore_hits_total")
        again, cached = complete(client, target)
        now = per_service(stack, "worker", "meshserve:worker_kvstore_loaded_blocks_total")
        gained = {w: now[w] - loaded[w] for w in now}
        (loader,) = [w for w in gained if gained[w] > 0]
        assert loader != computer, "the target went back to the worker that computed it"
        assert gained[loader] == (len(target) - 1) // BLOCK
        assert cached == gained[loader] * BLOCK
        assert metric(store_url, "meshserve:kvstore_hits_total") >= hits + gained[loader]
        assert again == computed, "KV loaded from the store gave a different output"


def stack_service(stack: Stack, role: str):  # type: ignore[no-untyped-def]
    (service,) = [s for s in stack.services if s.role == role]
    return service


def prefix_heavy(seed: int = 1) -> list[list[int]]:
    """Requests of 3 tenants (shared 6-block system prompts), each with its own question."""
    rng = random.Random(seed)
    tenants = [random_prompt(rng, 6)[: 6 * BLOCK] for _ in range(3)]
    order = [0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 1, 0]
    return [tenants[t] + [rng.randrange(5, 250) for _ in range(8)] for t in order]


def test_kv_aware_routing_caches_more_prompt_tokens_than_round_robin(
        model_dir: Path, tmp_path: Path) -> None:
    cached: dict[str, int] = {}
    for routing in ("kv-aware", "round-robin"):
        for stack in launch(model_dir, tmp_path / routing, routing=routing, kvstore=False,
                            num_kv_blocks=512):
            client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key="none")
            cached[routing] = sum(complete(client, p, max_tokens=2)[1]
                                  for p in prefix_heavy())
    # kv-aware: each tenant's 6 blocks are computed once, on one worker, and hit 9 times.
    assert cached["kv-aware"] == 9 * 6 * BLOCK, cached
    assert cached["round-robin"] < cached["kv-aware"], cached
