"""Readiness checks that `meshserve up` polls while its children start.

Each check is a callable that answers True once its service is ready; none raises.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshserve.proto.v1 import scheduler_pb2, scheduler_pb2_grpc


def grpc_serving(address: str) -> Callable[[], bool]:
    """A check: the server at `address` answers health SERVING."""
    def check() -> bool:
        with grpc.insecure_channel(address) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return response.status == health_pb2.HealthCheckResponse.SERVING
    return check


def http_ok(url: str) -> Callable[[], bool]:
    """A check: GET `url` answers 200."""
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False
    return check


def metric_is(url: str, sample: str) -> Callable[[], bool]:
    """A check: the Prometheus text at `url` has the line `sample` (e.g. "name 1.0")."""
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return response.status == 200 and sample in response.read().decode().splitlines()
        except (urllib.error.URLError, OSError):
            return False
    return check


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on host:port (a bind without SO_REUSEPORT fails)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        try:
            sock.bind(address)
        except OSError:
            return True
    return False


def workers_registered(scheduler: str, worker_ids: set[str]) -> Callable[[], bool]:
    """A check: the scheduler lists every one of `worker_ids`."""
    def check() -> bool:
        with grpc.insecure_channel(scheduler) as channel:
            try:
                listed = scheduler_pb2_grpc.SchedulerStub(channel).ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=2.0)
            except grpc.RpcError:
                return False
        return worker_ids <= {w.info.worker_id for w in listed.workers}
    return check
