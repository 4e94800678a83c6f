"""A meshserve service as its own process on 127.0.0.1, for contract tests.

    with service_process("encoder", ["--model", str(folder)], "meshserve.v1.Encoder") as at:
        channel = grpc.insecure_channel(at)

`service_process` starts `python -m meshserve.services.<role>` on a free port (the
environment's MESHSERVE_* settings left out, the hub offline), waits until its health
check says SERVING (failing at once if it exits), and stops it with SIGTERM after.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(address: str, service: str, process: subprocess.Popen[bytes],
                 timeout_s: float = 120.0) -> None:
    """Until `service` at `address` is SERVING; AssertionError if the process exits or the
    time runs out first."""
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, f"{service} exited while loading"
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=1.0, wait_for_ready=True).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"{service} never turned SERVING"
            time.sleep(0.1)  # polling health: loading sends no signal


@contextmanager
def service_process(role: str, args: Sequence[str], service: str) -> Iterator[str]:
    """The service running on a free port; yields its address."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    env["HF_HUB_OFFLINE"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-m", f"meshserve.services.{role}", *args, "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{port}"
        wait_serving(address, service, process)
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
