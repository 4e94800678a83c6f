"""`meshserve up --gateways 2`: two gateway processes on one port (SO_REUSEPORT), each
confirmed ready through its own /metrics port, both answering real OpenAI clients.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families

from meshserve.local.launcher import LauncherConfig, Stack, start_stack

MAX_CONNECTIONS = 40  # new connections tried until both gateways served one (2**-39 to fail)


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` has a listening socket on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text at `url` (0 when absent)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def completions_served(stack: Stack) -> list[float]:
    return [metric(url, "meshserve:gateway_requests_total", endpoint="/v1/completions",
                   status="200") for url in stack.gateway_metrics_urls]


def test_two_gateways_share_the_port_and_both_serve(tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    model = str(tiny_llama_dir)
    config = LauncherConfig(model=model, port=0, gateways=2, kvstore=False, device="cpu",
                            dtype="float32", num_kv_blocks=64, max_model_len=200,
                            run_dir=str(tmp_path / "run"), startup_timeout_s=120,
                            stop_grace_s=10)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    with start_stack(config, environ=env) as stack:
        gateways = [s for s in stack.services if s.role == "gateway"]
        assert [g.name for g in gateways] == ["gateway-0", "gateway-1"]
        pids = [g.process.pid for g in gateways if g.process is not None]
        assert len(set(pids)) == 2 and all(g.exit_code is None for g in gateways)
        for pid in pids:
            assert stack.gateway_port in listening_ports(pid), pid
        for url in stack.gateway_metrics_urls:
            assert metric(url, "meshserve:gateway_http_listening") == 1.0

        # Each client is a new connection, which the kernel hands to either gateway.
        for _ in range(MAX_CONNECTIONS):
            with openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0) as client:
                completion = client.completions.create(model=model, prompt="The quick",
                                                       max_tokens=3, temperature=0)
            assert completion.usage is not None and completion.usage.completion_tokens == 3
            if all(served > 0 for served in completions_served(stack)):
                break
        assert all(served > 0 for served in completions_served(stack))

        with openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0) as client:
            chunks = list(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                temperature=0, stream=True, stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 4
    assert all(g.exit_code is not None for g in gateways)
    assert all((stack.run_dir / f"{g.name}.log").is_file() for g in gateways)
