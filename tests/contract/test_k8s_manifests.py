"""The Kubernetes manifests of compose/k8s: they build (kustomize), validate against the
Kubernetes API schemas offline (kubernetes-validate, strict: unknown fields fail), and
follow the policy of docs/scaling.md: resources, a locked-down security context, three
probes, pinned images, a disruption budget per Deployment, an autoscaler per scalable
service on metrics the services export, and container flags that the services' own
config parsers accept. Every rule runs over each variant: the base (CPU workers), gpu,
vision (the base with image encoders), disagg (prefill and decode worker pools in place
of the mixed workers) and disagg-gpu (those pools on GPUs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_build import CLUSTER_SCOPED, Doc, build, container_env, find, load_documents, pod_spec

from meshserve.services.encoder.config import EncoderConfig
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.kvstore.config import KVStoreConfig
from meshserve.services.scheduler.config import SchedulerConfig
from meshserve.services.tokenizer.config import TokenizerConfig
from meshserve.services.worker.config import WorkerConfig
from meshserve.shared.config import ServiceConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "compose" / "k8s"
VARIANTS = ("base", "gpu", "vision", "disagg", "disagg-gpu")
# The oldest Kubernetes the manifests are written for (grpc probes, autoscaling/v2 and
# policy/v1 are all GA there); kubernetes-validate bundles its schemas.
KUBERNETES_VERSION = "1.30.0"
NAMESPACE = "meshserve"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CONFIGS: dict[str, type[ServiceConfig]] = {
    "gateway": GatewayConfig, "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig,
    "worker": WorkerConfig, "kvstore": KVStoreConfig, "encoder": EncoderConfig}
# The roles each variant runs, and which of them scale out.
ROLES = {"base": set(CONFIGS) - {"encoder"}, "gpu": set(CONFIGS) - {"encoder"},
         "vision": set(CONFIGS), "disagg": set(CONFIGS) - {"encoder"},
         "disagg-gpu": set(CONFIGS) - {"encoder"}}
SCALABLE = {"base": {"gateway", "tokenizer", "worker"}, "gpu": {"gateway", "tokenizer", "worker"},
            "vision": {"gateway", "tokenizer", "worker", "encoder"},
            "disagg": {"gateway", "tokenizer", "worker-prefill", "worker-decode"},
            "disagg-gpu": {"gateway", "tokenizer", "worker-prefill", "worker-decode"}}
# What saturates each scalable service: the exported gauge or the resource its autoscaler
# watches.
SATURATION = {"gateway": {"meshserve:gateway_requests_in_flight"},
              "tokenizer": {"Resource/cpu"},
              "worker": {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"},
              "encoder": {"meshserve:encoder_calls_in_flight"},
              "worker-prefill": {"meshserve:worker_pending_prefill_tokens"},
              "worker-decode": {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"}}
# Prometheus names of the gauges the autoscalers act on, as the services export them.
EXPORTED_METRICS = {"meshserve:gateway_requests_in_flight", "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc", "meshserve:encoder_calls_in_flight",
                    "meshserve:worker_pending_prefill_tokens", "vllm:num_requests_running"}
# What the vision variant adds to the base.
ENCODER_OBJECTS = {("Deployment", "encoder"), ("Service", "encoder-headless"),
                   ("PodDisruptionBudget", "encoder"), ("HorizontalPodAutoscaler", "encoder")}
# What the disagg variant puts in place of the base's mixed workers.
POOLS = {"worker-prefill": "prefill", "worker-decode": "decode"}
MIXED_OBJECTS = {("Deployment", "worker"), ("PodDisruptionBudget", "worker"),
                 ("HorizontalPodAutoscaler", "worker")}
METRICS_PORT = 8001
POD_IP = "10.1.2.3"
SECRET = "key-from-the-secret"


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def docs(variant: str) -> list[Doc]:
    return build(K8S / variant)


def of_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(deployment: Doc, *, init: bool = True) -> list[Doc]:
    spec = pod_spec(deployment)
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def is_mesh(container: Doc) -> bool:
    return container.get("command", [""])[0] == "meshserve"


def adapter_rules() -> list[dict[str, Any]]:
    config = find(build(K8S / "prometheus-adapter"), "ConfigMap", "adapter-config")
    rules: list[dict[str, Any]] = yaml.safe_load(config["data"]["config.yaml"])["rules"]
    return rules


def series_name(rule: dict[str, Any]) -> str:
    match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
    assert match, f"seriesQuery names no metric: {rule['seriesQuery']}"
    return match.group(1)


def test_every_kustomization_builds_into_named_namespaced_objects() -> None:
    for variant in (*VARIANTS, "prometheus-adapter"):
        objects = build(K8S / variant)
        keys = [(d["kind"], d["metadata"]["name"]) for d in objects]
        assert len(keys) == len(set(keys)), f"{variant}: duplicate objects"
        for doc in objects:
            if doc["kind"] not in CLUSTER_SCOPED:
                assert doc["metadata"]["namespace"], (variant, doc["metadata"]["name"])
    base = build(K8S / "base")
    assert find(base, "Namespace", NAMESPACE)
    assert {d["metadata"]["namespace"] for d in base if d["kind"] != "Namespace"} == {NAMESPACE}


def test_every_file_is_listed_by_a_kustomization() -> None:
    listed = {(K8S / v / "kustomization.yaml").resolve() for v in (*VARIANTS, "prometheus-adapter")}
    for variant in (*VARIANTS, "prometheus-adapter"):
        kustomization = yaml.safe_load((K8S / variant / "kustomization.yaml").read_text())
        entries = kustomization["resources"] + [p["path"] for p in kustomization.get("patches", [])]
        listed |= {(K8S / variant / e).resolve() for e in entries}
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml")}
    assert on_disk - listed == set(), "manifests no kustomization applies"


def test_every_object_validates_against_the_kubernetes_schemas(docs: list[Doc]) -> None:
    for doc in docs + build(K8S / "prometheus-adapter"):
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc}")


def test_every_validation_catches_an_unknown_field() -> None:
    """The schemas are strict: a misspelt field fails (so the test above can fail)."""
    gateway = find(build(K8S / "base"), "Deployment", "gateway")
    pod_spec(gateway)["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, KUBERNETES_VERSION, strict=True)


def test_every_container_has_requests_and_limits(docs: list[Doc]) -> None:
    for name, deployment in of_kind(docs, "Deployment").items():
        for container in containers(deployment):
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), (name, container["name"])


def test_every_pod_runs_as_non_root_on_a_read_only_root_without_capabilities(
        docs: list[Doc]) -> None:
    for name, deployment in of_kind(docs, "Deployment").items():
        spec = pod_spec(deployment)
        assert spec["automountServiceAccountToken"] is False, name
        for container in containers(deployment):
            effective = {**spec["securityContext"], **container.get("securityContext", {})}
            where = (name, container["name"])
            assert effective["runAsNonRoot"] is True and effective["runAsUser"] == 10001, where
            assert effective["readOnlyRootFilesystem"] is True, where
            assert effective["allowPrivilegeEscalation"] is False, where
            assert effective["capabilities"] == {"drop": ["ALL"]}, where
            assert effective["seccompProfile"] == {"type": "RuntimeDefault"}, where
            # Writable places are emptyDir volumes: /tmp for every mesh process.
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for volume in mounts.values():
                assert set(volumes[volume]) & {"emptyDir", "configMap"}, (where, volume)
            if is_mesh(container):
                assert "/tmp" in mounts, where


def test_every_container_has_startup_readiness_and_liveness_probes(docs: list[Doc]) -> None:
    for name, deployment in of_kind(docs, "Deployment").items():
        for container in containers(deployment, init=False):
            probes = [container[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")]
            declared = {p["name"] for p in container["ports"]} | {
                p["containerPort"] for p in container["ports"]}
            for probe in probes:
                action = probe.get("httpGet") or probe.get("grpc") or probe.get("exec")
                assert action, (name, probe)
                assert "port" not in action or action["port"] in declared, (name, probe)
            if not is_mesh(container):
                continue
            args = container["args"]
            port = int(args[args.index("--port") + 1])
            if container["command"][1] == "gateway":
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                assert ports["http"] == port
                assert probes[1]["httpGet"] == {"path": "/health", "port": "http"}
                # Liveness asks no peer: /health would restart gateways in any outage.
                assert probes[2]["httpGet"] == {"path": "/version", "port": "http"}
            else:  # grpc.health.v1 of the service's own server
                assert all(probe["grpc"] == {"port": port} for probe in probes), name


def test_every_image_is_pinned_to_the_project_version(docs: list[Doc]) -> None:
    for name, deployment in of_kind(docs, "Deployment").items():
        for container in containers(deployment):
            image = container["image"]
            repository, _, tag = image.rpartition(":")
            assert repository and tag and tag != "latest", (name, image)
            if is_mesh(container) or container["name"] == "prepare-cache":
                assert image in (f"meshserve:{VERSION}", f"meshserve-cuda:{VERSION}"), name


def test_every_deployment_has_one_disruption_budget(docs: list[Doc]) -> None:
    budgets = of_kind(docs, "PodDisruptionBudget")
    for name, deployment in of_kind(docs, "Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [b for b in budgets.values()
                    if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(matching) == 1, f"{name}: {len(matching)} disruption budgets"


def test_every_service_selects_pods_on_a_named_port(docs: list[Doc]) -> None:
    deployments = of_kind(docs, "Deployment").values()
    for name, service in of_kind(docs, "Service").items():
        selector = service["spec"]["selector"]
        pods = [d for d in deployments
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, name
        names = {p["name"] for c in containers(pods[0], init=False) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names, name


def test_every_container_flag_and_variable_is_one_its_service_reads(
        variant: str, docs: list[Doc]) -> None:
    """Each mesh container's args and environment, built by the service's own parser
    (strict: an unknown flag or MESHSERVE_* variable is an error)."""
    seen = set()
    for name, deployment in of_kind(docs, "Deployment").items():
        for container in filter(is_mesh, containers(deployment, init=False)):
            role = container["command"][1]
            assert container["command"] == ["meshserve", role], name
            env = container_env(container, docs, pod_ip=POD_IP, secret_value=SECRET)
            config = CONFIGS[role].from_args(container["args"], environ=env)
            seen.add(role)
            assert config.host == "0.0.0.0" and config.metrics_port == METRICS_PORT, name
            annotations = deployment["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(METRICS_PORT), name
            assert config.otlp_endpoint == "http://otel-collector:4317", name
            assert getattr(config, "redis_url", "redis://redis:6379/0") == \
                "redis://redis:6379/0", name
            if isinstance(config, WorkerConfig):
                assert config.advertise_address == f"{POD_IP}:{config.port}"
                assert config.scheduler_address == "scheduler:50052"
                assert config.kvstore_address == "kvstore:50054"
            if isinstance(config, GatewayConfig):
                assert config.api_key == SECRET
    assert seen == ROLES[variant]


def test_tokenizer_workers_and_encoders_read_one_model_setting(docs: list[Doc]) -> None:
    settings = find(docs, "ConfigMap", "meshserve-config")["data"]
    for name, deployment in of_kind(docs, "Deployment").items():
        container = pod_spec(deployment)["containers"][0]
        if not is_mesh(container) or container["command"][1] not in {"tokenizer", "worker",
                                                                      "encoder"}:
            continue
        role = container["command"][1]
        env = container_env(container, docs, pod_ip=POD_IP, secret_value=SECRET)
        config = CONFIGS[role].from_args(container["args"], environ=env)
        values = config.as_dict()
        assert values["model"] == settings["model"] == "default", name
        assert values.get("max_model_len") is None, name  # "" reads as unset


def test_gateway_finds_every_tokenizer_through_the_headless_service(docs: list[Doc]) -> None:
    gateway = pod_spec(find(docs, "Deployment", "gateway"))["containers"][0]
    config = GatewayConfig.from_args(gateway["args"], environ=container_env(
        gateway, docs, pod_ip=POD_IP, secret_value=SECRET))
    headless = find(docs, "Service", "tokenizer-headless")
    assert headless["spec"]["clusterIP"] == "None"
    port = headless["spec"]["ports"][0]["port"]
    namespace = headless["metadata"]["namespace"]
    assert config.tokenizer_addresses == (
        f"dns:///tokenizer-headless.{namespace}.svc:{port}",)


def test_replicas_behind_a_headless_service_end_connections_so_new_ones_are_found(
        docs: list[Doc]) -> None:
    """Clients name such replicas by one DNS name and gRPC resolves it again only when a
    connection ends: each replica ends its connections after a while, or pods the
    autoscaler adds would get no calls from the clients already running."""
    headless = [s for s in of_kind(docs, "Service").values()
                if s["spec"].get("clusterIP") == "None"]
    assert headless
    for service in headless:
        selector = service["spec"]["selector"].items()
        deployment = next(d for d in of_kind(docs, "Deployment").values()
                          if selector <= d["spec"]["template"]["metadata"]["labels"].items())
        container = pod_spec(deployment)["containers"][0]
        env = container_env(container, docs, pod_ip=POD_IP, secret_value=SECRET)
        config = CONFIGS[container["command"][1]].from_args(container["args"], environ=env)
        age = getattr(config, "max_connection_age_s", None)
        assert age is not None and 0 < age <= 120, service["metadata"]["name"]


def test_workers_find_every_encoder_through_the_headless_service() -> None:
    docs = build(K8S / "vision")
    worker = pod_spec(find(docs, "Deployment", "worker"))["containers"][0]
    config = WorkerConfig.from_args(worker["args"], environ=container_env(
        worker, docs, pod_ip=POD_IP, secret_value=SECRET))
    headless = find(docs, "Service", "encoder-headless")
    assert headless["spec"]["clusterIP"] == "None"
    port = headless["spec"]["ports"][0]["port"]
    namespace = headless["metadata"]["namespace"]
    # The gateway's form for the tokenizers (gateway.yaml).
    assert config.encoder_address_list == [f"dns:///encoder-headless.{namespace}.svc:{port}"]
    # Pods share no /dev/shm: rows come in the answers. With no encoder answering, the
    # worker encodes the images itself.
    assert config.encoder_shared_memory == "off"
    assert config.mm_encoder_placement == "auto"
    encoder = pod_spec(find(docs, "Deployment", "encoder"))["containers"][0]
    env = container_env(encoder, docs, pod_ip=POD_IP, secret_value=SECRET)
    assert EncoderConfig.from_args(encoder["args"], environ=env).port == port
    # torch's threads: as many as the CPUs the encoder may use.
    assert env["OMP_NUM_THREADS"] == encoder["resources"]["limits"]["cpu"]


def test_the_encoder_exports_the_gauge_its_autoscaler_reads() -> None:
    from prometheus_client import CollectorRegistry

    from meshserve.services.encoder.service import EncoderMetrics

    registry = CollectorRegistry()
    EncoderMetrics(registry)
    kinds = {m.name: m.type for m in registry.collect()}
    assert kinds["meshserve:encoder_calls_in_flight"] == "gauge"


def test_vision_variant_differs_only_by_the_encoders_and_workers_encoder_variables() -> None:
    base, vision = build(K8S / "base"), build(K8S / "vision")

    def key(doc: Doc) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    worker = ("Deployment", "worker")
    assert {key(d) for d in vision} - {key(d) for d in base} == ENCODER_OBJECTS
    assert [d for d in vision if key(d) not in ENCODER_OBJECTS | {worker}] == \
        [d for d in base if key(d) != worker]
    base_worker, vision_worker = find(base, *worker), find(vision, *worker)
    base_env = pod_spec(base_worker)["containers"][0].pop("env")
    vision_env = pod_spec(vision_worker)["containers"][0].pop("env")
    assert vision_worker == base_worker
    assert [e for e in vision_env if e in base_env] == base_env
    assert {e["name"] for e in vision_env if e not in base_env} == {
        "MESHSERVE_ENCODER_ADDRESSES", "MESHSERVE_ENCODER_SHARED_MEMORY"}


def test_disagg_variant_puts_two_pools_in_place_of_the_mixed_workers() -> None:
    """Each pool is the base's worker under its own name and labels, started with its
    --role; nothing else differs from the base."""
    base, disagg = build(K8S / "base"), build(K8S / "disagg")

    def key(doc: Doc) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    pool_objects = {(kind, name) for name in POOLS
                    for kind in ("Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler")}
    assert {key(d) for d in base} - {key(d) for d in disagg} == MIXED_OBJECTS
    assert {key(d) for d in disagg} - {key(d) for d in base} == pool_objects
    assert [d for d in base if key(d) not in MIXED_OBJECTS] == \
        [d for d in disagg if key(d) not in pool_objects]
    assert_pools_are(disagg, find(base, "Deployment", "worker"))


def test_disagg_gpu_variant_differs_only_in_its_pools_each_the_gpu_worker() -> None:
    disagg, gpu_pools = build(K8S / "disagg"), build(K8S / "disagg-gpu")

    def other(doc: Doc) -> bool:
        return doc["kind"] != "Deployment" or doc["metadata"]["name"] not in POOLS

    assert [d for d in disagg if other(d)] == [d for d in gpu_pools if other(d)]
    assert_pools_are(gpu_pools, find(build(K8S / "gpu"), "Deployment", "worker"))


def assert_pools_are(docs: list[Doc], mixed: Doc) -> None:
    """Each pool of `docs` is `mixed` under its own name and labels, with its --role."""
    for name, role in POOLS.items():
        pool = find(docs, "Deployment", name)
        container = pod_spec(pool)["containers"][0]
        config = WorkerConfig.from_args(container["args"], environ=container_env(
            container, docs, pod_ip=POD_IP, secret_value=SECRET))
        assert config.role == role and config.kv_offload, name
        assert container["args"][-2:] == ["--role", role]
        as_mixed = yaml.safe_load(yaml.safe_dump(pool).replace(name, "worker"))
        pod_spec(as_mixed)["containers"][0]["args"] = container["args"][:-2]
        assert as_mixed == mixed, name


def test_the_workers_export_the_gauges_the_pools_scale_on() -> None:
    from prometheus_client import CollectorRegistry

    from meshserve.services.worker.serving.role_metrics import register_role_gauges
    from meshserve.shared import vllm_metrics
    from meshserve.shared.worker_registry import WorkerLoad

    registry = CollectorRegistry()
    register_role_gauges(registry, "prefill", WorkerLoad)
    kinds = {m.name: m.type for m in registry.collect()}
    assert kinds["meshserve:worker_pending_prefill_tokens"] == "gauge"
    assert {vllm_metrics.NUM_RUNNING, vllm_metrics.KV_CACHE_USAGE} == \
        SATURATION["worker-decode"]


def test_the_api_key_comes_from_a_secret_and_is_never_inlined(docs: list[Doc]) -> None:
    assert not of_kind(docs, "Secret"), "an API key must not live in the repository"
    gateway = pod_spec(find(docs, "Deployment", "gateway"))["containers"][0]
    entry = next(e for e in gateway["env"] if e["name"] == "MESHSERVE_API_KEY")
    ref = entry["valueFrom"]["secretKeyRef"]
    assert "value" not in entry and "optional" not in ref  # no key: the pod waits
    assert "--api-key" not in gateway["args"]
    docs_text = (REPO / "docs" / "scaling.md").read_text()
    assert f"create secret generic {ref['name']} --from-literal={ref['key']}=" in docs_text


def test_collector_runs_the_compose_pipeline(docs: list[Doc]) -> None:
    compose = yaml.safe_load((REPO / "compose" / "otel-collector.yaml").read_text())
    config = yaml.safe_load(find(docs, "ConfigMap", "otel-collector")["data"]["config.yaml"])
    for section in ("receivers", "processors", "extensions"):
        assert config[section] == compose[section], section
    traces = config["service"]["pipelines"]["traces"]
    compose_traces = compose["service"]["pipelines"]["traces"]
    assert traces["receivers"] == compose_traces["receivers"]
    assert traces["processors"] == compose_traces["processors"]
    assert set(traces["exporters"]) <= set(config["exporters"])
    ports = {p["name"]: p["port"] for p in find(docs, "Service", "otel-collector")["spec"]["ports"]}
    endpoint = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert endpoint.endswith(f":{ports['otlp-grpc']}")
    # limit_mib below the container's memory limit, so the collector sheds load first.
    limit = pod_spec(find(docs, "Deployment", "otel-collector"))["containers"][0][
        "resources"]["limits"]["memory"]
    assert config["processors"]["memory_limiter"]["limit_mib"] < int(limit.removesuffix("Mi"))


def test_adapter_rules_expose_the_exported_gauges_as_pods_metrics() -> None:
    for rule in adapter_rules():
        source = series_name(rule)
        assert source in EXPORTED_METRICS, source
        assert re.fullmatch(rule["name"]["matches"], source), rule["name"]
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", rule["name"]["as"]), rule["name"]["as"]
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        for part in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert part in rule["metricsQuery"], part
    assert {series_name(r) for r in adapter_rules()} == EXPORTED_METRICS


def test_every_scalable_service_scales_on_what_saturates_it(
        variant: str, docs: list[Doc]) -> None:
    served = {r["name"]["as"]: series_name(r) for r in adapter_rules()}
    autoscalers = of_kind(docs, "HorizontalPodAutoscaler")
    assert set(autoscalers) == SCALABLE[variant]
    watched: dict[str, set[str]] = {}
    for name, hpa in autoscalers.items():
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        assert find(docs, "Deployment", name)
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"], name
        watched[name] = set()
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":
                watched[name].add(served[metric["pods"]["metric"]["name"]])
            else:
                watched[name].add(f"{metric['type']}/{metric['resource']['name']}")
    assert watched == {name: SATURATION[name] for name in SCALABLE[variant]}
    # The autoscalers own the replica counts: a Deployment that set one would be reset to
    # it by every `kubectl apply`.
    for name in SCALABLE[variant]:
        assert "replicas" not in find(docs, "Deployment", name)["spec"], name
    # CPU utilization is a share of the request: the tokenizer must request CPU.
    tokenizer = pod_spec(find(docs, "Deployment", "tokenizer"))["containers"][0]
    assert tokenizer["resources"]["requests"]["cpu"]


def test_gpu_variant_differs_only_in_its_workers() -> None:
    base, gpu = build(K8S / "base"), build(K8S / "gpu")
    assert [d for d in base if d["metadata"]["name"] != "worker" or d["kind"] != "Deployment"] \
        == [d for d in gpu if d["metadata"]["name"] != "worker" or d["kind"] != "Deployment"]
    cpu_worker = pod_spec(find(base, "Deployment", "worker"))
    gpu_worker = pod_spec(find(gpu, "Deployment", "worker"))
    cpu_args, gpu_args = cpu_worker["containers"][0]["args"], gpu_worker["containers"][0]["args"]
    assert cpu_args[cpu_args.index("--device") + 1] == "cpu"
    assert gpu_args[gpu_args.index("--device") + 1] == "cuda"
    assert "nvidia.com/gpu" not in cpu_worker["containers"][0]["resources"]["limits"]
    assert gpu_worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # A rollout frees a GPU before it asks for one (no surge pod waiting for a GPU).
    assert find(gpu, "Deployment", "worker")["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0, "maxUnavailable": 1}
    assert {c["image"] for c in containers(find(gpu, "Deployment", "worker"))} == {
        f"meshserve-cuda:{VERSION}"}
    # The base's env, mounts and volumes are kept; the GPU's caches come on top.
    for field in ("env", "volumeMounts"):
        kept = {e["name"] if field == "env" else e["mountPath"]
                for e in cpu_worker["containers"][0][field]}
        assert kept < {e["name"] if field == "env" else e["mountPath"]
                       for e in gpu_worker["containers"][0][field]}, field
    assert {v["name"] for v in gpu_worker["volumes"]} == {"cache", "tmp", "dshm"}


def test_every_raw_manifest_file_parses() -> None:
    for path in K8S.rglob("*.yaml"):
        assert load_documents(path), path


def test_prepare_cache_copies_the_images_default_model_into_the_writable_cache(
        tmp_path: Path) -> None:
    """The init container's script, run against a stand-in image cache: the .gguf lands
    where the main container's MESHSERVE_CACHE looks for it."""
    from meshserve.shared.default_model import GGUF_NAME

    image_cache, writable = tmp_path / "image-cache", tmp_path / "writable"
    (image_cache / "models").mkdir(parents=True)
    (image_cache / "models" / GGUF_NAME).write_bytes(b"GGUF stand-in")
    docs = build(K8S / "base")
    for name in ("tokenizer", "worker"):
        spec = pod_spec(find(docs, "Deployment", name))
        init, main = spec["initContainers"][0], spec["containers"][0]
        cache = container_env(main, docs, pod_ip=POD_IP, secret_value=SECRET)["MESHSERVE_CACHE"]
        assert "MESHSERVE_CACHE" not in {e["name"] for e in init.get("env", [])}, name
        assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]}[cache] == \
            {m["mountPath"]: m["name"] for m in main["volumeMounts"]}[cache], name
        command = [part.replace(cache, str(writable / name)) for part in init["command"]]
        assert command[:2] == ["python", "-c"], name
        subprocess.run([sys.executable, *command[1:]], check=True, timeout=60,
                       env={**os.environ, "MESHSERVE_CACHE": str(image_cache)})
        assert (writable / name / "models" / GGUF_NAME).read_bytes() == b"GGUF stand-in"
