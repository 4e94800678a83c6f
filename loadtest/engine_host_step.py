"""Host time of one engine decode step at a large batch, with the model's forward stubbed
out: what scheduling, input preparation, sampling bookkeeping and output deltas cost the
engine thread per step (on a GPU this runs while the device works; past the device's step
time it is the step time).

Driver part: none (a CPU benchmark, run by hand; figures in loadtest/reports/).

    python loadtest/engine_host_step.py [--running 1000] [--steps 250] [--model DIR]

Builds a tiny random model (tests/tiny_models.py) unless --model is given, adds --running
greedy requests of 100 prompt tokens, runs until all are decoding, then times --steps
decode steps one by one. Prints JSON: the median and p10 step in ms.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshserve.services.worker.builder import build_engine
from meshserve.services.worker.config import EngineConfig
from meshserve.shared.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--running", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny_models import build_tiny_model

            model = build_tiny_model(Path(tmp) / "m", "llama", seed=1, num_hidden_layers=1,
                                     max_position_embeddings=4096)
        engine = build_engine(EngineConfig(
            model=str(model), dtype="float32", device="cpu", num_kv_blocks=40000,
            max_num_seqs=args.running, max_num_batched_tokens=8192))
        hidden = engine.model_config.hidden_size
        # The forward pass stubbed out: hidden states of the right shape, at once.
        engine.runner.forward = lambda inputs: torch.zeros(inputs.input_ids.shape[0], hidden)
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
        for i in range(args.running):
            engine.add_request(f"r{i}", [rng.randrange(10, 200) for _ in range(100)], params)
        while (load := engine.load()).num_waiting or load.num_running < args.running:
            engine.step()
        for _ in range(5):
            engine.step()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    times.sort()
    print(json.dumps({"running": args.running, "steps": args.steps,
                      "median_ms": round(times[len(times) // 2] * 1e3, 2),
                      "p10_ms": round(times[len(times) // 10] * 1e3, 2)}))


if __name__ == "__main__":
    main()
