"""The GPU driver's part `disagg` on CPU, as `bash loadtest/gpu.sh disagg` runs it: two mixed
workers, then one prefill + one decode worker (`--kv-handoff tcp`), each stack up, warmed,
benchmarked on long prompts at a rate, scraped and stopped; then the summary of both.

The figures of a tiny model on a shared CPU say nothing about the SLOs: the test checks that
every run completed, that the prompts' KV went from the prefill worker to the decode worker,
that each stack was stopped, and that the summary is built from the runs' own files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from service_process import free_port

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 3
RECEIVED = "meshserve:kv_handoff_blocks_total{direction=received}"
SENT = "meshserve:kv_handoff_blocks_total{direction=sent}"


def test_the_part_sweeps_both_configs_and_summarises_them(tmp_path: Path,
                                                          tiny_llama_dir: Path) -> None:
    out, port = tmp_path / "out", free_port()
    knobs = {"OUT": str(out), "MODEL_DIR": str(tiny_llama_dir), "MAX_MODEL_LEN": "256",
             "RATES": "4", "PROMPTS_PER_RATE": str(PROMPTS), "LONG_PROMPT_MIN_LEN": "64",
             "LONG_PROMPT_MAX_LEN": "128", "LONG_PROMPT_MIN_OUTPUT_LEN": "8",
             "LONG_PROMPT_MAX_OUTPUT_LEN": "12", "PORT": str(port),
             "EXTRA_FLAGS": "--device cpu --dtype float32 --num-kv-blocks 256"}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **knobs}
    done = subprocess.run(["bash", "loadtest/gpu.sh", "disagg"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=500, check=False)
    part = out / "disagg"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for config in ("mixed", "disagg"):
        steps = (part / config / "steps.log").read_text()
        assert "== warmup: exit 0" in steps and "== rate_4: exit 0" in steps, steps
        result = json.loads((part / config / "rate_4.json").read_text())
        assert (result["completed"], result["failed"]) == (PROMPTS, 0)
        assert result["config"]["request_rate"] == 4.0
        assert {"p50_itl_ms", "p90_ttft_ms", "p99_itl_ms"} <= set(result)
    # The last stack is stopped: its gateway's port is free (closed connections may linger
    # in TIME_WAIT, which SO_REUSEADDR allows; a listener would not).
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
    services = json.loads((part / "disagg" / "metrics.json").read_text())["services"]
    received = services["decode-0"][RECEIVED]
    assert received > 0 and received == services["prefill-0"][SENT]
    assert services["decode-0"]["meshserve:kv_handoff_pulled_bytes_total{}"] > 0
    mixed = json.loads((part / "mixed" / "metrics.json").read_text())["services"]
    assert mixed["worker-0"][RECEIVED] == mixed["worker-1"][RECEIVED] == 0
    summary = json.loads((part / "summary.json").read_text())
    rate_4 = json.loads((part / "disagg" / "rate_4.json").read_text())
    (row,) = summary["configs"]["disagg"]["runs"]
    assert row["figures"]["p99_itl_ms"] == rate_4["p99_itl_ms"]
    assert summary["configs"]["disagg"]["kv_handoff"]["decode-0"][RECEIVED] == received
    text = (part / "summary.md").read_text()
    assert "## mixed: 2 mixed workers" in text and "## disagg against mixed" in text
