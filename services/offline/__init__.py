"""Offline inference (`meshserve run-batch`): an in-process engine and tokenizer in one process.

Not a service: like the launcher and the benchmarks, it composes the worker's engine and
the tokenizer's text side in one process, which no service may do.
"""
