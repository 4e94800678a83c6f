"""vLLM's metrics on the real stack under load: `meshserve up` (tokenizer, scheduler,
kvstore, a worker, the gateway; real Redis, gRPC and HTTP), the real `openai` client, then
every service's own /metrics and the gateway's merged /metrics/all, scraped and parsed."""

from __future__ import annotations

import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import build_tiny_model

from meshserve.local.launcher import LauncherConfig, start_stack
from meshserve.shared import vllm_metrics as vm

MODEL = "tiny"
MAX_MODEL_LEN = 512
LONG_PROMPT = " ".join(f"word{i}" for i in range(40))  # several full 16-token blocks

# Worker: name -> type, as vLLM exposes them.
WORKER_TYPES = {
    vm.NUM_RUNNING: "gauge", vm.NUM_WAITING: "gauge", vm.KV_CACHE_USAGE: "gauge",
    vm.PREFIX_CACHE_QUERIES: "counter", vm.PREFIX_CACHE_HITS: "counter",
    vm.NUM_PREEMPTIONS: "counter", vm.PROMPT_TOKENS: "counter",
    vm.GENERATION_TOKENS: "counter", vm.REQUEST_SUCCESS: "counter",
    vm.CACHE_CONFIG_INFO: "gauge", vm.ITERATION_TOKENS: "histogram",
    vm.REQUEST_PROMPT_TOKENS: "histogram", vm.REQUEST_GENERATION_TOKENS: "histogram",
    vm.REQUEST_PARAMS_N: "histogram", vm.REQUEST_PARAMS_MAX_TOKENS: "histogram",
    vm.TTFT: "histogram", vm.ITL: "histogram", vm.TPOT_LEGACY: "histogram",
    vm.REQUEST_TPOT: "histogram", vm.E2E: "histogram", vm.QUEUE_TIME: "histogram",
    vm.PREFILL_TIME: "histogram", vm.DECODE_TIME: "histogram", vm.INFERENCE_TIME: "histogram",
}
LENGTHS = vm.build_1_2_5_buckets(MAX_MODEL_LEN)
BUCKETS = {vm.TTFT: vm.TTFT_BUCKETS, vm.ITL: vm.ITL_BUCKETS, vm.TPOT_LEGACY: vm.ITL_BUCKETS,
           vm.REQUEST_TPOT: vm.ITL_BUCKETS, vm.ITERATION_TOKENS: vm.ITERATION_TOKENS_BUCKETS,
           vm.REQUEST_PARAMS_N: vm.PARAMS_N_BUCKETS, vm.REQUEST_PROMPT_TOKENS: LENGTHS,
           vm.REQUEST_GENERATION_TOKENS: LENGTHS, vm.REQUEST_PARAMS_MAX_TOKENS: LENGTHS,
           **dict.fromkeys((vm.E2E, vm.QUEUE_TIME, vm.PREFILL_TIME, vm.DECODE_TIME,
                            vm.INFERENCE_TIME), vm.REQUEST_LATENCY_BUCKETS)}


def scrape(url: str) -> dict:
    """Families by name (counters without `_total`, as the parser names them)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def total(families: dict, sample_name: str, **labels: str) -> float:
    family = families[sample_name.removesuffix("_total").removesuffix("_count")
                      .removesuffix("_sum")]
    return sum(s.value for s in family.samples if s.name == sample_name
               and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    model = build_tiny_model(tmp_path_factory.mktemp("model"), "llama", seed=11,
                             max_position_embeddings=MAX_MODEL_LEN)
    config = LauncherConfig(model=str(model), served_model_name=MODEL, workers=1, port=0,
                            num_kv_blocks=128, dtype="float32", device="cpu",
                            run_dir=str(tmp_path_factory.mktemp("run")),
                            startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


@pytest.fixture(scope="module")
def load(stack):
    """Scrapes before and after: plain, streamed, a repeated long prompt (a prefix-cache
    hit), and n=2. Returns (before, after, usage totals, sequences finished)."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
    worker_url = stack.metrics_urls["worker-0"]
    before = scrape(worker_url)
    prompt = completion = sequences = 0
    for body in ({"prompt": "hello there", "max_tokens": 5},
                 {"prompt": LONG_PROMPT, "max_tokens": 3},
                 {"prompt": LONG_PROMPT, "max_tokens": 3},
                 {"prompt": "two answers", "max_tokens": 4, "n": 2}):
        answer = client.completions.create(model=MODEL, temperature=0.0, **body)
        assert answer.usage is not None
        prompt += answer.usage.prompt_tokens
        completion += answer.usage.completion_tokens
        sequences += len(answer.choices)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    prompt += usage.prompt_tokens
    completion += usage.completion_tokens
    sequences += 1
    return before, scrape(worker_url), prompt, completion, sequences


def test_worker_exports_vllm_names_types_labels_and_buckets(load) -> None:
    _, after, *_ = load
    for name, kind in WORKER_TYPES.items():
        family = after[name.removesuffix("_total") if kind == "counter" else name]
        assert family.type == kind, name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", name
    for name, bounds in BUCKETS.items():
        les = [s.labels["le"] for s in after[name].samples if s.name == f"{name}_bucket"]
        assert les == [*(repr(float(b)) for b in bounds), "+Inf"], name
    reasons = {s.labels["finished_reason"] for s in after["vllm:request_success"].samples}
    assert reasons == set(vm.FINISH_REASONS)


def test_worker_counters_grow_by_what_the_requests_got(load) -> None:
    before, after, prompt, completion, sequences = load

    def grew(sample_name: str, **labels: str) -> float:
        return total(after, sample_name, **labels) - total(before, sample_name, **labels)

    assert grew("vllm:generation_tokens_total") == completion
    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:request_success_total") == sequences
    assert grew("vllm:request_generation_tokens_sum") == completion
    assert grew("vllm:request_params_n_count") == 5
    assert grew("vllm:request_params_n_sum") == 6
    assert grew("vllm:e2e_request_latency_seconds_count") == sequences
    assert grew("vllm:request_queue_time_seconds_count") == sequences
    # The second long prompt found the first one's full blocks in the prefix cache.
    assert grew("vllm:prefix_cache_hits_total") >= 32
    assert grew("vllm:prefix_cache_queries_total") >= prompt
    assert grew("vllm:iteration_tokens_total_sum") == prompt + completion
    assert total(after, "vllm:num_requests_running") == 0


def test_gateway_and_mesh_services_export_their_names(stack, load) -> None:
    *_, completion, _ = load
    urls = stack.metrics_urls
    gateway = scrape(urls["gateway"])
    assert gateway["meshserve:gateway_requests_in_flight"].type == "gauge"
    for name in (vm.TTFT, vm.ITL, vm.E2E):
        assert {s.labels["engine"] for s in gateway[name].samples} == {"gateway"}
        assert {s.labels["model_name"] for s in gateway[name].samples} == {MODEL}
    assert total(gateway, "vllm:generation_tokens_total", engine="gateway") == completion
    assert total(gateway, "vllm:request_success_total", finished_reason="length") >= 1
    assert "meshserve:scheduler_route_decisions" in scrape(urls["scheduler"])
    assert "meshserve:tokenizer_requests" in scrape(urls["tokenizer-0"])
    assert "meshserve:kvstore_blocks" in scrape(urls["kvstore"])
    for name, url in urls.items():
        names = scrape(url)
        assert not [n for n in names if n.startswith("meshserve_")], name


def test_merged_scrape_holds_every_service(stack, load) -> None:
    merged = scrape(f"{stack.gateway_url}/metrics/all")
    services = {s.labels["service"] for family in merged.values() for s in family.samples}
    assert services == {"gateway", "tokenizer-0", "scheduler", "kvstore", "worker-0"}
    engines = {s.labels["service"] for s in merged[vm.TTFT].samples}
    assert engines == {"gateway", "worker-0"}


def test_up_prints_every_metrics_port(stack) -> None:
    urls = stack.metrics_urls
    assert set(urls) == {"launcher", "gateway", "tokenizer-0", "scheduler", "kvstore",
                         "worker-0"}
    assert len({url for url in urls.values()}) == len(urls)
