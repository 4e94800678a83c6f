"""`meshserve bench serve`: the serving benchmark against any OpenAI-compatible server.

    meshserve bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt-like \
        --model-config MODEL_DIR --num-prompts 1000 --ignore-eos --max-concurrency 256

A pure HTTP client (aiohttp, streamed SSE): it never imports torch. Modules:
- cli: `main(argv)`; config: the flags (`ServeConfig`);
- datasets, sharegpt, workload: the prompts (token ids shared with `meshserve bench
  throughput`);
- client: one streamed request and its timings; runner: arrivals, concurrency, sweep;
- metrics: vLLM's result fields; report: table and JSON; plot: the PNG (matplotlib).
"""
