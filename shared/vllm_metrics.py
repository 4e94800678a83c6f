"""vLLM's metric names, bucket boundaries and labels, so that vLLM's dashboards and alerts
read meshserve unchanged (docs/metrics.md lists every metric and which service exports it).

Names are given as prometheus_client takes them: a Counter named `vllm:prompt_tokens` is
exposed as `vllm:prompt_tokens_total`, exactly vLLM's exposed name. Bucket boundaries are
vLLM v1's (its `vllm/v1/metrics/loggers.py`); the token-count histograms use its 1-2-5
series up to the model's context length.
"""

from __future__ import annotations

# Every vLLM-named series carries these labels: the served model name and the engine
# (vLLM's engine-core index; a worker is engine "0", the gateway says "gateway").
LABELS = ("model_name", "engine")

# Scheduler state and the KV cache (gauges, counters).
NUM_RUNNING = "vllm:num_requests_running"
NUM_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
# Token counters and per-request histograms.
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
# Latencies.
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
TPOT_LEGACY = "vllm:time_per_output_token_seconds"  # older name of the same data as ITL
REQUEST_TPOT = "vllm:request_time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
INFERENCE_TIME = "vllm:request_inference_time_seconds"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# Inter-token latency, the legacy time per output token and the per-request one.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
# e2e, queue, prefill, decode and inference time of a request.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# vLLM's finish reasons (the `finished_reason` label of vllm:request_success).
FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10
