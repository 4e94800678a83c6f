"""Tensor parallelism: one model replica over several devices (see docs/tensor_parallel.md)."""
