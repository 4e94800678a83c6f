"""The hottest Python functions of a `py-spy record -f raw` profile, by self and total samples.

    python loadtest/pyspy_top.py spy.txt [--within bench_throughput] [--top 40]

`--within NAME` keeps only the stacks that pass through a function of that name (the timed
part of a benchmark, without the model's load and warm-up).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pyspy_top.py")
    parser.add_argument("profile", type=Path)
    parser.add_argument("--within", default="")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    self_count: collections.Counter[str] = collections.Counter()
    total_count: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in args.profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if args.within and not any(f.startswith(args.within + " ") for f in frames):
            continue
        n = int(count)
        samples += n
        self_count[frames[-1]] += n
        for frame in set(frames):
            total_count[frame] += n
    print(f"{samples} samples{' within ' + args.within if args.within else ''}")
    for title, counter in (("self", self_count), ("total", total_count)):
        print(f"\n== by {title} samples")
        for frame, n in counter.most_common(args.top):
            print(f"{100 * n / max(samples, 1):6.1f}%  {frame[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
