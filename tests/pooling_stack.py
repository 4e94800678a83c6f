"""The whole mesh serving a pooling model (`meshserve up --runner pooling`, one worker, no
kvstore, float32 on the CPU) for the e2e tests of the scoring, classify and pooling
endpoints, and the `openai` client at the gateway's root (vLLM serves /score, /rerank,
/classify and /pooling there)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai

from meshserve.local.launcher import LauncherConfig, start_stack


@contextmanager
def pooling_stack(model_dir: Path, served_name: str, run_dir: Path,
                  max_model_len: int) -> Iterator[Any]:
    config = LauncherConfig(model=str(model_dir), served_model_name=served_name,
                            runner="pooling", workers=1, port=0, dtype="float32",
                            device="cpu", kvstore=False, max_model_len=max_model_len,
                            run_dir=str(run_dir), startup_timeout_s=300, stop_grace_s=10)
    with start_stack(config) as running:
        yield running


def root_client(stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_url, api_key="none", max_retries=0,
                         timeout=120)
