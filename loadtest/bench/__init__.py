"""Benchmarks: `meshserve bench latency|throughput` (engine.py) and `bench serve` (serve/)."""
