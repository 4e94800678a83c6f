"""The Grafana dashboard cannot drift from the metrics: every metric name a panel reads is
one the services register, and compose/check_dashboard.py reports the queries a Prometheus
answers with nothing (here a stand-in Prometheus HTTP API on 127.0.0.1)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from meshserve.services.gateway.merged_metrics import MergedMetrics
from meshserve.services.gateway.metrics import GatewayMetrics
from meshserve.services.kvstore.service import StoreCollector
from meshserve.services.kvstore.store import KVBlockStore
from meshserve.services.scheduler.metrics import SchedulerMetrics
from meshserve.services.scheduler.queue import GlobalQueue
from meshserve.services.tokenizer.service import TokenizerMetrics
from meshserve.services.worker.serving.vllm_metrics import WorkerVllmMetrics
from meshserve.shared.telemetry import Telemetry
from meshserve.shared.worker_registry import WorkerLoad

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "compose" / "grafana" / "dashboards" / "meshserve.json"
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "info": ("_info",)}


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_dashboard",
                                                  REPO / "compose" / "check_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_dashboard"] = module
    spec.loader.exec_module(module)
    return module


checker = _load_checker()


def exported_series() -> set[str]:
    """Series names every service's registry can expose (families with no sample yet
    included), built from the services' own metric classes."""
    registry = CollectorRegistry()
    Telemetry("test", registry=registry)
    GatewayMetrics(registry)
    MergedMetrics(registry, "gateway", "h:1", [], lambda: None)  # type: ignore[arg-type]
    SchedulerMetrics(registry, GlobalQueue(4))
    TokenizerMetrics(registry)
    registry.register(StoreCollector(KVBlockStore(1 << 20)))
    worker = CollectorRegistry()  # apart: it registers names the gateway also registers
    WorkerVllmMetrics(worker, "m", 1024, load=WorkerLoad, totals=lambda: (0, 0, 0),
                      cache_info={})
    names = set()
    for reg in (registry, worker):
        for family in reg.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_a_panel_reads_is_exported(dashboard: dict) -> None:
    exported = exported_series()
    targets = list(checker.panel_targets(dashboard))
    assert len(targets) > 30
    missing = {(t.panel, name) for t in targets for name in checker.metric_names(t.expr)
               if name not in exported}
    assert not missing, f"panels read metrics no service exports: {sorted(missing)}"
    read = {name for t in targets for name in checker.metric_names(t.expr)}
    for wanted in ("vllm:e2e_request_latency_seconds_bucket", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                   "vllm:request_prompt_tokens_bucket", "vllm:request_success_total",
                   "meshserve:scheduler_route_overlap_ratio_sum",
                   "meshserve:gateway_requests_in_flight", "meshserve:kvstore_hits_total"):
        assert wanted in read, wanted


def test_panels_are_laid_out_on_the_grid_and_use_the_provisioned_source(dashboard) -> None:
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "prometheus", panel["title"]


def test_variables_take_their_all_value() -> None:
    expr = 'rate(x{model_name=~"$model_name"}[$__rate_interval]) + y{a=~"${job}"}'
    assert checker.fill_variables(expr, "90s") == 'rate(x{model_name=~".*"}[90s]) + y{a=~".*"}'


class _Prometheus(BaseHTTPRequestHandler):
    """/api/v1/query: one series, except for queries naming `vllm:num_preemptions`."""

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["query"][0]
        result = [] if "vllm:num_preemptions" in query else [{"metric": {}, "value": [0, "1"]}]
        body = json.dumps({"status": "success",
                           "data": {"resultType": "vector", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_checker_lists_the_empty_queries_and_fails(dashboard, prometheus, tmp_path,
                                                    capsys) -> None:
    empty = checker.check(dashboard, prometheus, "1m")
    assert [line.split(":")[0] for line in empty] == ["Preemptions [A]"]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dashboard))
    assert checker.main(["--prometheus", prometheus, "--dashboard", str(path)]) == 1
    assert "1 of" in capsys.readouterr().err
    ok = {"panels": [p for p in dashboard["panels"] if p.get("title") != "Preemptions"]}
    path.write_text(json.dumps(ok))
    assert checker.main(["--prometheus", prometheus, "--dashboard", str(path)]) == 0


def _default_port(value: str) -> int:
    """`${VAR:-9101}` (compose's form) -> 9101."""
    match = re.fullmatch(r"\$\{\w+:-(\d+)\}", str(value))
    assert match, value
    return int(match.group(1))


def test_prometheus_scrapes_every_role_where_compose_serves_metrics() -> None:
    import yaml

    config = yaml.safe_load((REPO / "compose" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gateway", "tokenizer", "scheduler", "kvstore", "worker"}
    compose = yaml.safe_load((REPO / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    # Where compose serves each service's /metrics (the gateway: on its API port).
    served = {name: _default_port(services[name]["environment"]["MESHSERVE_METRICS_PORT"])
              for name in ("tokenizer", "scheduler", "kvstore", "worker", "worker-gpu-0",
                           "worker-gpu-1", "worker-prefill", "worker-decode")}
    served["gateway"] = _default_port(services["gateway"]["environment"]["MESHSERVE_PORT"])
    scraped: dict[str, int] = {}
    for job in jobs.values():
        for c in job.get("dns_sd_configs", []):
            for name in c["names"]:
                scraped[name] = c["port"]
        for c in job.get("static_configs", []):
            for target in c["targets"]:
                name, port = target.rsplit(":", 1)
                scraped[name] = int(port)
    assert scraped == served
    source = yaml.safe_load((REPO / "compose" / "grafana" / "provisioning" / "datasources" /
                             "prometheus.yaml").read_text())["datasources"][0]
    assert (source["uid"], source["url"]) == ("prometheus", "http://prometheus:9090")
    grafana = compose["services"]["grafana"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
