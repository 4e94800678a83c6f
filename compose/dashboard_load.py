"""Load for the dashboard check (compose/dashboard_check.sh): for `--seconds`, a few client
threads send completions through the real `openai` client: plain and streamed, a shared
long prefix (prefix-cache hits), n=2, and one chat request; prints what was sent.

    python compose/dashboard_load.py --base-url http://127.0.0.1:8000/v1 --model tiny
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time

import openai
from openai.types import CompletionUsage

_PREFIX = " ".join(f"shared{i}" for i in range(48))  # several full KV blocks


def _one(client: openai.OpenAI, model: str, i: int) -> int:
    """One request of the mix; the tokens it produced."""
    kind = i % 4
    usage: CompletionUsage | None
    if kind == 0:
        usage = client.completions.create(model=model, prompt=f"{_PREFIX} question {i}",
                                          max_tokens=8, temperature=0.0).usage
    elif kind == 1:
        usage = client.completions.create(model=model, prompt=f"number {i}", max_tokens=6,
                                          n=2, temperature=0.7).usage
    elif kind == 2:
        stream = client.completions.create(model=model, prompt=f"stream {i}", max_tokens=12,
                                           stream=True, stream_options={"include_usage": True})
        usages = [c.usage for c in stream if c.usage is not None]
        usage = usages[-1] if usages else None
    else:
        usage = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=10).usage
    return usage.completion_tokens if usage else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=120)
    counter = itertools.count()
    totals = {"requests": 0, "tokens": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + args.seconds

    def run() -> None:
        while time.monotonic() < deadline:
            tokens = _one(client, args.model, next(counter))
            with lock:
                totals["requests"] += 1
                totals["tokens"] += tokens

    threads = [threading.Thread(target=run) for _ in range(args.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"load: {totals['requests']} requests, {totals['tokens']} completion tokens in "
          f"{args.seconds:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
