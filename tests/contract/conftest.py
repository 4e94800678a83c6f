"""Fixtures shared by the contract tests: the worker and tokenizer harnesses
(tests/worker_harness.py, tests/tokenizer_harness.py)."""

from tokenizer_harness import harness, hf, served
from worker_harness import worker

__all__ = ["harness", "hf", "served", "worker"]
