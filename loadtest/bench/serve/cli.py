"""`meshserve bench serve`: parse the flags, build the prompts, run, report.

Exit codes: 0 when the run completed (failed requests are counted, not fatal); 2 for bad
input (flags, files, tokenizer, missing matplotlib for --plot), before anything is sent; 1
when the server cannot be used (unreachable, refuses the key, fails every warm-up request).
"""

from __future__ import annotations

import asyncio
import resource
import sys
from collections.abc import Sequence

from meshserve.bench.serve import plot, report
from meshserve.bench.serve.config import ServeConfig, normalize_argv
from meshserve.bench.serve.runner import run_benchmark
from meshserve.bench.serve.workload import build_workload
from meshserve.shared.errors import ConfigError, MeshError

PROG = "meshserve bench serve"


def _fail(message: str, code: int) -> int:
    prefix = f"{PROG}: "
    print(prefix + message.removeprefix(prefix), file=sys.stderr)
    return code


def raise_open_files_limit(connections: int | None) -> None:
    """Lift the soft limit of open files to the hard one when `connections` (None: an
    unknown number) might not fit under it, as vLLM's benchmark does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if connections is None else min(hard, connections + 256)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or wanted <= soft:
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def main(argv: Sequence[str]) -> int:
    """`meshserve bench serve [FLAGS]`; returns the exit code."""
    try:
        config = ServeConfig.from_args(normalize_argv(argv), strict_env=False, prog=PROG)
        if config.plot is not None:
            plot.require_matplotlib()
        workload = build_workload(config)
    except ConfigError as exc:
        return _fail(exc.message, 2)
    caps = config.concurrencies
    raise_open_files_limit(None if None in caps else max(c for c in caps if c is not None))
    try:
        results = asyncio.run(run_benchmark(config, workload))
    except MeshError as exc:
        return _fail(exc.message, 1)
    sweep = config.concurrency_sweep is not None
    print(report.render(results, sweep))
    if config.output_json is not None:
        report.write_json(config.output_json, report.document(config, results))
    if config.plot is not None:
        plot.write_plot(config.plot, results, sweep)
    return 0
