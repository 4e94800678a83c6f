"""EncodePool: small prompts inline, large ones on a bounded pool of threads, each thread
with its own tokenizer copy; past the waiting bound large prompts are refused."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from typing import Any

import pytest
from tiny_models import build_tokenizer

from meshserve.services.tokenizer.encode_pool import EncodePool, PromptLimits
from meshserve.services.tokenizer.loader import Tokenizer
from meshserve.services.tokenizer.model import PromptInput, ServedModel
from meshserve.shared.errors import OverloadedError


class GatedTokenizer:
    """A real tokenizer whose encode waits for `gate` off the main thread (copies share the
    gate and the record of which thread encoded with which copy)."""

    def __init__(self, inner: Tokenizer, gate: threading.Event,
                 users: list[tuple[int, int]], lock: threading.Lock) -> None:
        self.inner, self.gate, self.users, self.lock = inner, gate, users, lock
        self.busy = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> GatedTokenizer:
        return GatedTokenizer(copy.deepcopy(self.inner, memo), self.gate, self.users, self.lock)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if threading.current_thread() is not threading.main_thread():
            with self.lock:
                self.busy += 1
                assert self.busy == 1, "two threads used one tokenizer copy at once"
                self.users.append((threading.get_ident(), id(self)))
            self.gate.wait(timeout=30)
            with self.lock:
                self.busy -= 1
        return self.inner.encode(text, add_special_tokens)


async def _until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_large_prompts_use_the_threads_and_the_bound_refuses_more() -> None:
    hf = build_tokenizer()
    real = Tokenizer(hf, name="tiny")
    gate, users, lock = threading.Event(), [], threading.Lock()
    model = ServedModel(GatedTokenizer(real, gate, users, lock), ("tiny",), 4096)  # type: ignore[arg-type]
    pool = EncodePool(PromptLimits(workers=2, large_prompt_chars=20))
    pool.set_model(model)
    texts = [f"prompt number {i} is long enough to be large" for i in range(16)]
    large = [asyncio.ensure_future(pool.tokenize(model, PromptInput(text=t))) for t in texts]
    await _until(lambda: len(users) == 2)  # both threads hold a prompt, 14 wait
    # Small prompts are answered on the event loop meanwhile; the 17th large one is refused.
    small = await pool.tokenize(model, PromptInput(text="hi fox"))
    assert small.token_ids == real.encode("hi fox")
    with pytest.raises(OverloadedError):
        await pool.tokenize(model, PromptInput(text=texts[0]))
    assert not any(task.done() for task in large)
    gate.set()
    results = await asyncio.gather(*large)
    assert [r.token_ids for r in results] == [real.encode(t) for t in texts]
    # At most two threads encoded, each on a copy of its own (never the served tokenizer).
    copies_by_thread: dict[int, set[int]] = {}
    for thread, copy_id in users:
        copies_by_thread.setdefault(thread, set()).add(copy_id)
    assert len(copies_by_thread) <= 2 and len(users) == 16
    assert id(model.tokenizer) not in {copy_id for _, copy_id in users}
    # Once drained, large prompts are accepted again.
    again = await pool.tokenize(model, PromptInput(text=texts[1]))
    assert again.token_ids == real.encode(texts[1])
