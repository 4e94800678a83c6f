"""Host time of the n-gram proposer per speculating sequence per step, by context length.

Driver part: none (a CPU benchmark cited by docs/speculative.md).

    python loadtest/ngram_cost.py [--lengths 512 4096 16384] [--sequences 64]

Each sequence proposes `num_speculative_tokens` drafts and answers `may_draft` (what a
speculating sequence costs the engine thread every step), on random contexts of the given
length over a 32,000-token vocabulary (few matches: every n is tried). The batch proposer
keeps each sequence's tokens as an array that a step appends one token to; the figure
"from a list" converts the whole context every time, for comparison. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from meshserve.services.worker.engine.sequence import SequenceState
from meshserve.services.worker.spec.decoder import NgramBatchProposer
from meshserve.services.worker.spec.ngram import NgramProposer
from meshserve.shared.sampling_params import SamplingParams
from meshserve.shared.speculative_config import SpeculativeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    config = SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=1)
    results = []
    for length in args.lengths:
        proposer = NgramBatchProposer(config)
        requests = [SequenceState(f"r{i}", [rng.randrange(32000) for _ in range(length)],
                            SamplingParams(), max_tokens=args.steps + 1)
                    for i in range(args.sequences)]
        proposer.propose_batch(requests, [4] * len(requests))  # the first step reads it all
        started = time.perf_counter()
        for _ in range(args.steps):
            for request in requests:  # one new token per sequence per step
                request.output_token_ids.append(rng.randrange(32000))
            proposer.propose_batch(requests, [4] * len(requests))
            for request in requests:
                proposer.may_draft(request)
        per_step = (time.perf_counter() - started) / args.steps / len(requests)
        plain = NgramProposer(4, 1, 4)
        started = time.perf_counter()
        for request in requests:
            plain.propose(request.all_token_ids)
            plain.propose(request.all_token_ids, 1)
        from_list = (time.perf_counter() - started) / len(requests)
        results.append({"context_tokens": length, "us_per_sequence_step": round(per_step * 1e6, 1),
                        "us_from_a_list": round(from_list * 1e6, 1)})
    print(json.dumps({"sequences": args.sequences, "results": results}, indent=1))


if __name__ == "__main__":
    main()
