"""n-gram speculation on a real model and real text (loadtest/spec_bench.py --real-model):
acceptance as a model's own answers give it, where the answer quotes the prompt.

Driver part: `spec` (through spec_bench.py --real-model).

Two chat requests: rewrite a 37-line Python function with one variable renamed (the answer is
mostly the function again), and summarise a short report quoting its key sentences. Each runs
greedy without drafts and with n-gram drafts on one engine (the synchronous loop for both, so
only speculation differs); the decoded texts must be identical.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from typing import Any

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.services.worker.spec.decoder import SpecDecoder

FUNCTION = '''def summarize_orders(orders, tax_rate, currency="EUR"):
    """Totals per customer, with tax, skipping cancelled orders."""
    totals = {}
    counts = {}
    skipped = 0
    for order in orders:
        if order.status == "cancelled":
            skipped += 1
            continue
        customer = order.customer_id
        amount = 0.0
        for line in order.lines:
            price = line.unit_price * line.quantity
            if line.discount:
                price = price * (1 - line.discount)
            amount += price
        amount = amount * (1 + tax_rate)
        if customer not in totals:
            totals[customer] = 0.0
            counts[customer] = 0
        totals[customer] += amount
        counts[customer] += 1
    report = []
    for customer, amount in sorted(totals.items()):
        average = amount / counts[customer]
        report.append({
            "customer": customer,
            "orders": counts[customer],
            "total": round(amount, 2),
            "average": round(average, 2),
            "currency": currency,
        })
    if skipped:
        report.append({"skipped": skipped})
    return report
'''

REPORT = ("The storage cluster lost one of its three metadata servers at 02:14 after a disk "
          "controller failed. Writes kept working because the two remaining servers still "
          "formed a quorum. Read latency rose from 4 ms to 19 ms for forty minutes while "
          "clients retried against the failed server. The on-call engineer removed the failed "
          "server from the client configuration at 02:55, and latency returned to normal. No "
          "data was lost. The team will add a health check that removes a failed metadata "
          "server automatically, and will replace the disk controller on Thursday.")

PROMPTS = {
    "code_rename": ("Rewrite this Python function, renaming the variable `amount` to `value`. "
                    "Return the whole function and nothing else.\n\n" + FUNCTION),
    "summary_quote": ("Summarize this incident report in three sentences, quoting its key "
                      "sentences word for word.\n\n" + REPORT),
}

RunMode = Callable[..., dict[str, Any]]


def chat_tokens(tokenizer: Any, text: str) -> list[int]:
    """The chat template around one user message, as token ids."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def real_model_run(model: str, device: str, k: int, max_tokens: int,
                   run_mode: RunMode) -> dict[str, Any]:
    """Both prompts, without and with n-gram drafts (k, lookup 1..4 tokens)."""
    from transformers import AutoTokenizer

    from meshserve.shared.model_source import resolve_model, tokenizer_folder

    source = resolve_model(None if model == "default" else model)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(source))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    engine = build_engine(EngineConfig(model=model, device=device, max_model_len=2048,
                                       max_num_seqs=8, speculative_config=spec))
    ngram = engine.hook(SpecDecoder)
    out: dict[str, Any] = {"model": model, "device": _device(engine), "k": k,
                           "max_tokens": max_tokens, "prompts": {}}
    for name, text in PROMPTS.items():
        prompt = chat_tokens(tokenizer, text)
        entry: dict[str, Any] = {"prompt_len": len(prompt)}
        for mode, spec_decoder in (("baseline", None), ("ngram", ngram)):
            # The answer ends at the model's end of turn, as a served request would.
            result = run_mode(engine, spec_decoder, False, prompt, max_tokens, ignore_eos=False)
            result["output_tokens"] = len(result["tokens"])
            result["text"] = tokenizer.decode(result.pop("tokens"))
            entry[mode] = result
            print(f"real {name} {mode}: TPOT {result['tpot_ms']:.2f} ms, acceptance "
                  f"{result.get('acceptance_rate')}, tokens/step "
                  f"{result['tokens_per_step']:.2f}", flush=True)
        entry["identical"] = entry["baseline"]["text"] == entry["ngram"]["text"]
        entry["speedup"] = entry["baseline"]["tpot_ms"] / entry["ngram"]["tpot_ms"]
        out["prompts"][name] = entry
    del engine
    gc.collect()
    return out


def _device(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(engine.device)
    import os

    return f"cpu ({os.cpu_count()} cores)"
