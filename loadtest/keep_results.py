"""Copy one GPU suite run's files into loadtest/reports/NAME, small enough to commit.

    python loadtest/keep_results.py FILES_DIR loadtest/reports/NAME

FILES_DIR holds what the suite left in $OUT. The summaries, results.json and suite.log are
copied; each mesh run's `bench serve` JSON files are kept without their per-request arrays
(ttfts, itls, ...: the figures computed from them stay), its engine step traces are gzipped,
and its py-spy samples and service logs are kept as they are.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import tarfile
from pathlib import Path

_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "start_times",
                "statuses", "errors")


def strip(doc: dict) -> dict:
    results = doc.get("results")
    if isinstance(results, list):
        doc["results"] = [strip(r) for r in results]
    return {k: v for k, v in doc.items() if k not in _PER_REQUEST}


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("summary.md", "results.json", "suite.log", "steps.tar.gz"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    for summary in src.glob("mesh_summary*.md"):
        shutil.copy(summary, dst / summary.name)
    for packed in src.glob("mesh_g*.tar.xz"):
        with tarfile.open(packed) as tar:
            for member in tar.getmembers():
                if not member.isfile():
                    continue
                target = dst / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if member.name.endswith(".json") and "/run/" not in member.name:
                    data = (json.dumps(strip(json.loads(data)), indent=1) + "\n").encode()
                if "worker_steps.jsonl" in member.name:  # a line per engine step: packed
                    target = target.with_name(target.name + ".gz")
                    data = gzip.compress(data)
                target.write_bytes(data)


if __name__ == "__main__":
    main()
