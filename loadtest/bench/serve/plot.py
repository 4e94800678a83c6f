"""`--plot`: a PNG of the run (matplotlib, an optional dependency: `pip install meshserve[bench]`).

One run: the CDFs of TTFT, TPOT, ITL and E2E latency. A sweep: output throughput and ITL
p50/p99 against concurrency, above the four CDFs with one line per concurrency.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meshserve.bench.serve.metrics import MS_PER_S, request_tpot
from meshserve.shared.errors import ConfigError

_CDFS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def require_matplotlib() -> None:
    """ConfigError at start-up (not after the run) when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib, which is not installed: "
                          "pip install 'meshserve[bench]' (or matplotlib)", param="plot")


def samples_ms(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-metric samples of the successful requests of one result, in milliseconds."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    ttft, e2el, lens = result["ttfts"], result["e2els"], result["output_lens"]
    values = {
        "ttft": [ttft[i] for i in ok],
        "tpot": [request_tpot(e2el[i], ttft[i], lens[i]) for i in ok if lens[i] > 1],
        "itl": [gap for i in ok for gap in result["itls"][i]],
        "e2el": [e2el[i] for i in ok]}
    return {k: np.sort(np.asarray(v, dtype=float)) * MS_PER_S for k, v in values.items()}


def _cdf(ax: Any, values: np.ndarray, label: str | None) -> None:
    if values.size:
        ax.plot(values, np.arange(1, values.size + 1) / values.size, label=label,
                drawstyle="steps-post")


def write_plot(path: Path, results: Sequence[dict[str, Any]], sweep: bool) -> None:
    """Draw the run (or sweep) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 3 if sweep else 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    cdf_axes = axes[1:].ravel() if sweep else axes.ravel()
    for ax, (key, title) in zip(cdf_axes, _CDFS, strict=True):
        for result in results:
            label = f"concurrency {result['max_concurrency']}" if sweep else None
            _cdf(ax, samples_ms(result)[key], label)
        ax.set(title=f"{title} CDF", xlabel="ms",
               ylabel="fraction of gaps" if key == "itl" else "fraction of requests")
        ax.grid(alpha=0.3)
        if sweep:
            ax.legend(fontsize="small")
    if sweep:
        x = [r["max_concurrency"] for r in results]
        throughput, itl = axes[0]
        throughput.plot(x, [r["output_throughput"] for r in results], marker="o")
        throughput.set(title="Output throughput", xlabel="max concurrency", ylabel="tokens/s",
                       xscale="log")
        for key, label in (("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99")):
            itl.plot(x, [r[key] for r in results], marker="o", label=label)
        itl.set(title="Inter-token latency", xlabel="max concurrency", ylabel="ms",
                xscale="log")
        itl.legend()
        for ax in axes[0]:
            ax.grid(alpha=0.3)
    fig.suptitle(f"meshserve bench serve: {results[0].get('model', '')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
