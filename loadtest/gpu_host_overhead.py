"""Host (CPU) time of eager forward passes on the GPU, by function: what launching costs.

Builds an engine for the Llama-3.1-8B-shaped model cut to a few layers (dummy weights),
then profiles eager forwards of a batch-1 decode step and of a mixed step with cProfile,
and times the launch of each kind of kernel on its own (no device sync inside the loop).

    python loadtest/gpu_host_overhead.py --model loadtest/models/llama-3.1-8b --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshserve.services.bench import random_prompts
from meshserve.services.worker.engine.config import EngineConfig
from meshserve.services.worker.engine.engine import LLMEngine
from meshserve.shared.sampling_params import SamplingParams


def host_profile(engine: LLMEngine, steps: int, title: str, out: list[str],
                 before_step: Callable[[int], None] = lambda _: None) -> float:
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    started = time.perf_counter()
    prof.enable()
    for i in range(steps):
        before_step(i)
        engine.step()
    prof.disable()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / steps * 1e3
    buffer = io.StringIO()
    pstats.Stats(prof, stream=buffer).sort_stats("tottime").print_stats(30)
    out.append(f"== {title}: {wall:.2f} ms/step under cProfile\n{buffer.getvalue()}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    config = json.loads((Path(args.model) / "config.json").read_text())
    config["num_hidden_layers"] = args.layers
    (tmp / "config.json").write_text(json.dumps(config))
    text: list[str] = []
    report: dict[str, float] = {}
    engine = LLMEngine(EngineConfig(model=str(tmp), load_format="dummy", max_model_len=2048,
                                    enforce_eager=True, async_scheduling="off"))
    greedy = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    engine.add_request("a", random_prompts([128], engine.model_config, 0)[0], greedy)
    for _ in range(10):
        engine.step()
    started = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    report["decode_b1_ms_per_step"] = (time.perf_counter() - started) / 50 * 1e3
    report["decode_b1_ms_per_step_cprofile"] = host_profile(
        engine, 50, f"batch-1 eager decode, {args.layers} layers", text)
    engine.abort_request("a")
    engine.step()
    # A mixed step: 250 decoding sequences and one 450-token prompt chunk.
    prompts = random_prompts([200] * 250, engine.model_config, 1)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, greedy)
    while any(s.is_prefilling for i in range(250) for s in engine.sequences(f"d{i}")):
        engine.step()
    for _ in range(3):
        engine.step()
    chunks = random_prompts([450] * 10, engine.model_config, 10)

    def add_chunk(j: int) -> None:
        engine.add_request(f"m{j}", chunks[j], SamplingParams(temperature=0.0, max_tokens=1,
                                                              ignore_eos=True))

    report["mixed_ms_per_step_cprofile"] = host_profile(
        engine, 10, f"mixed eager steps (250 decodes + a 450-token prompt), {args.layers} "
                    f"layers", text, add_chunk)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_overhead.txt").write_text("\n".join(text))
    (args.out / "host_overhead.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print("\n".join(text))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
