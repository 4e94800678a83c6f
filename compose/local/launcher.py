"""`meshserve up`: the whole mesh on one machine, one process per service.

    with start_stack(LauncherConfig(model="path/to/model", workers=2, port=0)) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none")
        ...

Starts an embedded Redis (unless `--redis-url`), then the tokenizer(s), scheduler,
kvstore, N workers and the gateway(s) as `python -m meshserve.services.<role>` with
loopback ports chosen up front, and waits until every one is healthy (gRPC health
SERVING, every worker registered, each gateway listening as its own /metrics port
reports, and /health 200 on the shared HTTP port), within `--startup-timeout-s`; a
service that exits or stays unhealthy is named in the error with the tail of its log.
Child logs go to files in a run folder. Stopping (Ctrl-C, SIGTERM, `Stack.stop()`) sends
SIGTERM to the gateways first, then to the rest, and SIGKILL after `--stop-grace-s`.

Once up, the stack is supervised (supervisor.py): a child, or the embedded Redis,
that dies on its own is started again on the same address after a backoff, within
`--restart-budget` restarts per `--restart-window-s`; past it that child is given up, and
the stack stops (exit 1) only when what is left cannot serve. The launcher's own /metrics
(`--metrics-port`) counts restarts per service.

Every service serves its own /metrics on a port of its own (`Stack.metrics_urls`, printed
by `meshserve up`): free ports by default, or with `--metrics-port B` (env
MESHSERVE_METRICS_PORT) B for the launcher and B+1, B+2, ... for the services in start
order, so that a Prometheus config can name them. The gateway's /metrics/all merges them
all (docs/metrics.md).

`--gateways N` (N > 1) starts N gateway processes, gateway-0..N-1, on the same host:port
with SO_REUSEPORT: the kernel spreads new connections over them, and each keeps its own
channels and sessions to the other services. A lone gateway is named `gateway` and
listens without SO_REUSEPORT, so that a taken port is an error rather than shared. The
command line (`meshserve up`, `meshserve serve MODEL`) is compose/cli/up.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from prometheus_client import start_http_server

from meshserve.local.children import (
    RedisChild,
    ServiceProcess,
    child_env,
    terminate,
)
from meshserve.local.media_options import MediaOptions
from meshserve.local.probes import (
    grpc_serving,
    http_ok,
    metric_is,
    port_taken,
    workers_registered,
)
from meshserve.local.supervisor import RestartPolicy, Supervisor
from meshserve.services.worker.config import EngineConfig
from meshserve.services.worker.runner_config import RunnerOptions
from meshserve.shared.config import option
from meshserve.shared.errors import ConfigError, UnavailableError
from meshserve.shared.redis_server import EmbeddedRedis, find_free_port

_LOOPBACK = "127.0.0.1"
# --gateways 0: one gateway per this many cores, at most this many gateways.
_CORES_PER_GATEWAY = 8
_MAX_AUTO_GATEWAYS = 4
_GATEWAY_LISTENING = "meshserve:gateway_http_listening 1.0"  # a sample of its /metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class LauncherConfig(MediaOptions, RunnerOptions, EngineConfig):
    """The whole mesh on this machine; engine and runner options go to every worker."""

    workers: int = option(1, "model workers to start (mixed: prefill and decode both)")
    prefill_workers: int = option(0, "prefill workers to start (disaggregated serving: they "
                                     "compute prompts and hand their KV to decode workers)")
    decode_workers: int = option(0, "decode workers to start (they continue the requests "
                                    "prefill workers hand off, and run short prompts whole)")
    kv_handoff: Literal["store", "tcp", "ipc"] = option(
        "store", "how prefill workers hand prompts' KV to decode workers: through the kvstore "
        "(store), pulled over TCP (tcp), or copied GPU to GPU on one host (ipc; TCP "
        "between hosts)")
    kv_handoff_hold_bytes: int | None = option(
        None, "most bytes of handed-off KV a prefill worker holds for decode workers (with "
              "ipc, the pool each prefill and decode worker takes from its GPU at start; "
              "unset: the worker's default)")
    kv_handoff_push: bool = option(
        False, "with ipc: prefill workers push prompts' KV into the decode worker's pool "
               "layer by layer as computed (off: decode workers copy it after the first "
               "token)")
    kv_handoff_send_timeout_s: float | None = option(
        None, "longest a prefill worker waits for a prompt's KV to be ready to hand off "
              "(unset: the worker's default)")
    disagg_min_prompt_tokens: int | None = option(
        None, "prompts shorter than this skip the prefill workers (unset: the scheduler's "
              "default)")
    tokenizers: int = option(1, "tokenizer replicas to start")
    encoders: int = option(0, "image encoder services to start for a vision-language model "
                              "(0: the workers encode images themselves)")
    gateways: int = option(1, "gateway processes sharing the HTTP port (SO_REUSEPORT when "
                              "more than 1); 0: one per 8 CPU cores, from 1 to 4")
    kvstore: bool = option(True, "start the KV-cache store")
    kvstore_capacity_bytes: int | None = option(None, "bytes of KV blocks the kvstore holds "
                                                      "(unset: the kvstore's default)")
    host: str = option(_LOOPBACK, "address the gateway listens on (0.0.0.0: all interfaces)")
    port: int = option(8000, "HTTP port of the gateway (0: any free port)")
    redis_url: str | None = option(None, "external Redis (unset: start an embedded one)")
    routing: Literal["kv-aware", "round-robin", "least-loaded", "random"] = option(
        "kv-aware", "the scheduler's routing policy: kv-aware, round-robin, least-loaded or "
        "random")
    api_key: str | None = option(None, "Bearer token clients must send to the gateway (unset: "
                                       "no auth)")
    served_model_name: str | None = option(None, "name clients use for the model (unset: the "
                                                 "--model value)")
    allowed_origins: str | None = option(None, "origins a browser may call the API from "
                                               "(CORS), comma-separated; '*': any (unset: none)")
    access_log: bool = option(True, "the gateway logs one line per API request")
    root_path: str = option("", "path prefix the gateway also serves the API under "
                                "(behind a proxy), e.g. /llm")
    tool_call_parser: str | None = option(
        None, "how tool calls are read from the output for tool_choice 'auto' (hermes, "
              "qwen3, qwen3_coder, llama3_json, mistral)")
    enable_auto_tool_choice: bool = option(
        False, "let tool_choice 'auto' parse tool calls with --tool-call-parser")
    reasoning_parser: str | None = option(
        None, "split a reasoning model's thinking into reasoning_content (deepseek_r1, qwen3)")
    enable_tokenizer_info_endpoint: bool = option(
        False, "the gateway answers GET /tokenizer_info (as vLLM; off: 404)")
    enable_server_load_tracking: bool = option(
        False, "the gateway counts requests in flight for GET /load (as vLLM)")
    enable_request_id_headers: bool = option(
        False, "an X-Request-Id header on every gateway response (the caller's, else new)")
    run_dir: str | None = option(None, "folder for the services' logs (unset: a new "
                                       "temporary folder)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option("INFO", "services' "
                                                                             "log level")
    otlp_endpoint: str | None = option(None, "OTLP gRPC endpoint for every service's traces",
                                       env="OTEL_EXPORTER_OTLP_ENDPOINT")
    startup_timeout_s: float = option(600.0, "how long the services may take to be healthy")
    stop_grace_s: float = option(30.0, "how long services may drain before SIGKILL")
    restart_budget: int = option(5, "restarts of one service allowed per --restart-window-s "
                                    "before it is given up (0: a service that dies stops the "
                                    "stack)")
    restart_window_s: float = option(300.0, "window of --restart-budget, in seconds")
    metrics_port: int = option(0, "first of the stack's /metrics ports: the launcher's own "
                                  "(service restarts) is this one, each service the next in "
                                  "start order (tokenizers, scheduler, kvstore, workers, "
                                  "gateways); 0: any free ports")

    @property
    def num_gateways(self) -> int:
        """Gateway processes to start: --gateways, or by cores when it is 0. One gateway is
        one event-loop thread; past a few hundred concurrent streams (or a burst of
        requests arriving at once) one core no longer keeps up (docs/scaling.md)."""
        if self.gateways:
            return self.gateways
        return min(max((os.cpu_count() or 1) // _CORES_PER_GATEWAY, 1), _MAX_AUTO_GATEWAYS)

    @property
    def num_workers(self) -> int:
        """Workers of every role."""
        return self.workers + self.prefill_workers + self.decode_workers

    @property
    def worker_roles(self) -> list[tuple[str, str]]:
        """(worker id, role) of each worker to start: mixed ones, then prefill, decode."""
        return ([(f"worker-{i}", "mixed") for i in range(self.workers)]
                + [(f"prefill-{i}", "prefill") for i in range(self.prefill_workers)]
                + [(f"decode-{i}", "decode") for i in range(self.decode_workers)])

    def validate(self) -> None:
        super().validate()
        self.require(self.tokenizers >= 1, f"must be at least 1, got {self.tokenizers}",
                     "tokenizers")
        for name in ("workers", "prefill_workers", "decode_workers"):
            value = getattr(self, name)
            self.require(value >= 0, f"must be >= 0, got {value}", name)
        self.require(self.num_workers >= 1, "needs at least one worker (--workers, "
                     "--prefill-workers or --decode-workers)", "workers")
        self.require(self.kvstore or self.kv_handoff != "store"
                     or not (self.prefill_workers or self.decode_workers),
                     "prefill and decode workers hand KV over through the kvstore (or "
                     "--kv-handoff tcp or ipc)", "kvstore")
        self.require(self.encoders >= 0, f"must be >= 0, got {self.encoders}", "encoders")
        self.require(self.gateways >= 0, f"must be >= 0 (0: by cores), got {self.gateways}",
                     "gateways")
        self.require(0 <= self.port <= 65535, f"must be in [0, 65535], got {self.port}", "port")
        self.require(self.restart_budget >= 0, f"must be >= 0, got {self.restart_budget}",
                     "restart_budget")
        self.require(0 <= self.metrics_port <= 65535,
                     f"must be in [0, 65535], got {self.metrics_port}", "metrics_port")
        for name in ("startup_timeout_s", "stop_grace_s", "restart_window_s"):
            value = getattr(self, name)
            self.require(value > 0, f"must be positive, got {value}", name)


def _worker_devices(config: LauncherConfig) -> list[list[str]]:
    """Per-worker flags placing workers: a GPU each (round-robin), or a share of the CPU."""
    count = 0
    if config.device in ("auto", "cuda"):
        import torch  # only to count GPUs (slow to import)

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = config.tensor_parallel_size  # a worker's ranks take GPUs index, index + 1, ...
    if count:
        if tp > count:
            raise ConfigError(f"--tensor-parallel-size {tp} needs {tp} GPUs; {count} found",
                              param="tensor_parallel_size")
        groups = count // tp  # whole groups of tp GPUs, used round-robin
        per_gpu = -(-config.num_workers // groups)
        share = [] if per_gpu == 1 else ["--gpu-memory-utilization",
                                         f"{config.gpu_memory_utilization / per_gpu:.3f}"]
        return [["--device", f"cuda:{(i % groups) * tp}", *share]
                for i in range(config.num_workers)]
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // (config.num_workers * tp))
    return [["--num-threads", str(threads)] for _ in range(config.num_workers)]


class Stack:
    """A running mesh: its URLs and addresses, and `stop()` (also on leaving `with`)."""

    def __init__(self, config: LauncherConfig, run_dir: Path,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self._environ = dict(os.environ if environ is None else environ)
        self._redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url or ""
        self.services: list[ServiceProcess] = []
        self._picked: set[int] = set()
        # --metrics-port B: the services' metrics ports follow the launcher's, in start order.
        self._next_metrics_port = config.metrics_port + 1 if config.metrics_port else 0
        port = config.port or self._free_port()
        shown = _LOOPBACK if config.host in ("0.0.0.0", "::", "") else config.host
        self._gateway_host = shown
        self.gateway_url = f"http://{shown}:{port}"
        self.gateway_port = port
        self.tokenizer_addresses = [self._free() for _ in range(config.tokenizers)]
        self.scheduler_address = self._free()
        self.kvstore_address = self._free() if config.kvstore else None
        self.encoder_addresses = [self._free() for _ in range(config.encoders)]
        self.worker_addresses = [self._free() for _ in range(config.num_workers)]
        self.worker_ids = [worker_id for worker_id, _ in config.worker_roles]
        self.gateway_names = (["gateway"] if config.num_gateways == 1 else
                              [f"gateway-{i}" for i in range(config.num_gateways)])
        self._supervisor: Supervisor | None = None
        self._metrics_server: Any = None
        self.launcher_metrics_url = ""
        self._fatal = threading.Event()
        self.fatal_reason: str | None = None
        self._stopped = False

    @property
    def base_url(self) -> str:
        """The OpenAI API root (`{gateway_url}/v1`)."""
        return f"{self.gateway_url}/v1"

    @property
    def gateway_metrics_urls(self) -> list[str]:
        """Each gateway's own /metrics (the shared HTTP port reaches any one of them)."""
        return [s.metrics_url for s in self.services if s.role == "gateway"]

    def model_names(self) -> list[str]:
        """The model ids the gateway serves (what clients pass as `model`)."""
        request = urllib.request.Request(f"{self.base_url}/models")
        if self.config.api_key:
            request.add_header("Authorization", f"Bearer {self.config.api_key}")
        with urllib.request.urlopen(request, timeout=10.0) as response:
            return [m["id"] for m in json.loads(response.read())["data"]]

    def _free_port(self) -> int:
        """A free loopback port that no earlier pick of this stack returned.

        Picked ports stay unbound until their service starts, so the kernel may hand the same
        one out twice; two services given one port would fail to start or, worse, a probe
        would reach the wrong one."""
        while (port := find_free_port(_LOOPBACK)) in self._picked:
            pass
        self._picked.add(port)
        return port

    def _metrics_port(self) -> int:
        """The next service's /metrics port: the next after --metrics-port, or a free one."""
        if not self._next_metrics_port:
            return self._free_port()
        port = self._next_metrics_port
        self._next_metrics_port += 1
        self._picked.add(port)
        return port

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each service's own /metrics by name (the launcher's as "launcher", once up)."""
        urls = {s.name: s.metrics_url for s in self.services}
        if self.launcher_metrics_url:
            urls["launcher"] = self.launcher_metrics_url
        return urls

    def _free(self) -> str:
        return f"{_LOOPBACK}:{self._free_port()}"

    def _common(self, address: str | None = None) -> list[str]:
        flags = ["--log-level", self.config.log_level,
                 "--drain-grace-s", str(max(self.config.stop_grace_s - 2.0, 0.5))]
        if self.config.otlp_endpoint:
            flags += ["--otlp-endpoint", self.config.otlp_endpoint]
        if address is not None:
            host, port = address.rsplit(":", 1)
            flags += ["--host", host, "--port", port]
        return flags

    def _plan(self) -> None:
        """The child processes, in start order."""
        c, names = self.config, []
        model = c.model or "default"
        if c.served_model_name:
            names = ["--served-model-name", c.served_model_name]
        for i, address in enumerate(self.tokenizer_addresses):
            self._add(f"tokenizer-{i}", "tokenizer", [*self._common(address), "--model", model,
                                                      *names], grpc_serving(address))
        self._add("scheduler", "scheduler", [*self._common(self.scheduler_address),
                                             "--redis-url", self.redis_url,
                                             "--block-size", str(c.block_size),
                                             "--routing", c.routing, *(
                      [] if c.disagg_min_prompt_tokens is None else
                      ["--disagg-min-prompt-tokens", str(c.disagg_min_prompt_tokens)])],
                  grpc_serving(self.scheduler_address))
        if self.kvstore_address is not None:
            capacity = ([] if c.kvstore_capacity_bytes is None
                        else ["--capacity-bytes", str(c.kvstore_capacity_bytes)])
            self._add("kvstore", "kvstore", [*self._common(self.kvstore_address),
                                             "--redis-url", self.redis_url, *capacity],
                      grpc_serving(self.kvstore_address))
        for i, address in enumerate(self.encoder_addresses):
            self._add(f"encoder-{i}", "encoder", [
                *self._common(address), "--model", model, "--device", c.device,
                "--dtype", c.dtype, "--load-format",
                "dummy" if c.load_format == "dummy" else "auto"], grpc_serving(address))
        served = ["--served-model-names", c.served_model_name] if c.served_model_name else []
        if self.kvstore_address is not None:
            served += ["--kvstore-address", self.kvstore_address]
        if self.encoder_addresses:
            served += ["--encoder-addresses", ",".join(self.encoder_addresses)]
        for (worker_id, role), address, placement in zip(
                c.worker_roles, self.worker_addresses, _worker_devices(c), strict=True):
            self._add(worker_id, "worker", [
                *self._common(address), "--worker-id", worker_id, "--role", role,
                "--redis-url", self.redis_url,
                "--scheduler-address", self.scheduler_address, *served,
                *(["--kv-handoff", c.kv_handoff] if c.kv_handoff != "store" else []),
                *(["--kv-handoff-hold-bytes", str(c.kv_handoff_hold_bytes)]
                  if c.kv_handoff_hold_bytes and role != "mixed" else []),
                *(["--kv-handoff-push"] if c.kv_handoff_push and role != "mixed" else []),
                *(["--kv-handoff-send-timeout-s", str(c.kv_handoff_send_timeout_s)]
                  if c.kv_handoff_send_timeout_s and role == "prefill" else []),
                *c.engine_flags(), *c.runner_flags(), *placement], grpc_serving(address))
        gateway = [*self._common(), "--host", c.host, "--port", str(self.gateway_port),
                   "--tokenizer-addresses", ",".join(self.tokenizer_addresses),
                   "--scheduler-address", self.scheduler_address]
        if c.served_model_name:
            gateway += ["--served-model-names", c.served_model_name]
        if c.api_key:
            gateway += ["--api-key", c.api_key]
        if c.allowed_origins:
            gateway += ["--allowed-origins", c.allowed_origins]
        gateway += ["--redis-url", self.redis_url]  # stored /v1/responses answers
        if not c.access_log:
            gateway.append("--no-access-log")
        for flag, value in (("--root-path", c.root_path),
                            ("--tool-call-parser", c.tool_call_parser),
                            ("--reasoning-parser", c.reasoning_parser)):
            if value:
                gateway += [flag, value]
        for switch in ("enable_auto_tool_choice", "enable_tokenizer_info_endpoint",
                       "enable_server_load_tracking", "enable_request_id_headers",
                       "enable_prompt_embeds"):
            if getattr(c, switch):
                gateway.append("--" + switch.replace("_", "-"))
        gateway += c.media_flags()
        if c.num_gateways > 1:
            gateway.append("--reuse-port")
        # /metrics/all: the services planned so far; workers advertise theirs themselves.
        gateway += ["--metrics-targets", ",".join(
            f"{s.name}={s.metrics_url}" for s in self.services if s.role != "worker")]
        for name in self.gateway_names:
            # Its own /metrics is the one probe that reaches this process and no other.
            metrics_port = self._metrics_port()
            metrics_url = f"http://{self._gateway_host}:{metrics_port}/metrics"
            self._add(name, "gateway", gateway, metric_is(metrics_url, _GATEWAY_LISTENING),
                      metrics_port, self._gateway_host)

    def _add(self, name: str, role: str, argv: list[str], ready: Callable[[], bool],
             metrics_port: int | None = None, metrics_host: str = _LOOPBACK) -> None:
        """Plan one child, with a /metrics port of its own (a free one unless given)."""
        metrics_port = metrics_port or self._metrics_port()
        self.services.append(ServiceProcess(
            name, role, [*argv, "--metrics-port", str(metrics_port)],
            self.run_dir / f"{name}.log", ready,
            f"http://{metrics_host}:{metrics_port}/metrics"))

    def start(self, say: Callable[[str], None] = lambda _: None) -> Self:
        """Start Redis and every service; return once all are healthy (else stop, raise)."""
        if self.config.num_gateways > 1 and self.config.port and port_taken(
                self.config.host, self.gateway_port):
            raise UnavailableError(
                f"port {self.gateway_port} on {self.config.host} is taken; the gateways "
                f"listen with SO_REUSEPORT and would share it with its owner", param="port")
        try:
            if not self.redis_url:
                self._redis = self._start_redis()
                self.redis_url = self._redis.url
                say(f"embedded Redis at {self.redis_url}")
            self._plan()
            for service in self.services:
                service.start(child_env(service.role, self._environ))
                say(f"started {service.name} (log {service.log_path})")
            self._wait_ready(say)
            self._supervise(say)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_redis(self) -> EmbeddedRedis:
        """The embedded Redis, on a port none of this stack's services was given."""
        for attempt in range(3):
            try:
                return EmbeddedRedis(self._free_port()).start()
            except UnavailableError:
                # Another process may have bound the port since it was picked: pick again.
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _supervise(self, say: Callable[[str], None]) -> None:
        """Watch the children from now on (a thread), and serve the launcher's /metrics."""
        children: list[Any] = list(self.services)
        if self._redis is not None:
            children.append(RedisChild(self._redis))
        policy = RestartPolicy(budget=self.config.restart_budget,
                               window_s=self.config.restart_window_s)
        self._supervisor = Supervisor(children, policy, can_serve=self._cannot_serve_why,
                                      say=say, on_fatal=lambda why: self._on_fatal(why, say))
        port = self.config.metrics_port or self._free_port()
        self._metrics_server, _ = start_http_server(port, _LOOPBACK,
                                                    registry=self._supervisor.registry)
        self.launcher_metrics_url = f"http://{_LOOPBACK}:{port}/metrics"
        self._supervisor.start()

    def _cannot_serve_why(self, given_up: set[str]) -> str | None:
        """Why the services not given up cannot serve, or None if they can."""
        if "redis" in given_up:
            return "the embedded Redis was given up"
        for role in ("gateway", "tokenizer", "scheduler", "worker"):
            names = {s.name for s in self.services if s.role == role}
            if names and names <= given_up:
                return f"every {role} was given up ({', '.join(sorted(names))})"
        return None

    def _on_fatal(self, why: str, say: Callable[[str], None]) -> None:
        self.fatal_reason = why
        say(f"the stack cannot serve: {why}")
        self._fatal.set()

    def running(self) -> bool:
        """Started, not stopped, and able to serve (nothing essential given up)."""
        return self._supervisor is not None and not self._stopped and not self._fatal.is_set()

    def _child(self, name: str) -> Any:
        if name == "redis":
            assert self._redis is not None, "this stack uses an external Redis"
            return RedisChild(self._redis)
        return self._service(name)

    def pid(self, name: str) -> int | None:
        """The process id of a child ("redis": the embedded Redis), None if not running."""
        if name == "redis":
            return None if self._redis is None else self._redis.pid
        process = self._service(name).process
        return None if process is None or process.poll() is not None else process.pid

    def kill(self, name: str, sig: int) -> None:
        """Send `sig` to a child (fault drills: what the supervisor must survive)."""
        pid = self.pid(name)
        assert pid is not None, f"{name} is not running"
        os.kill(pid, sig)

    def service_healthy(self, name: str) -> bool:
        """Whether a child runs and passes its readiness check right now."""
        child = self._child(name)
        return child.exit_code is None and child.ready()

    def restarts(self, name: str) -> int:
        """How many times the supervisor started `name` again."""
        return 0 if self._supervisor is None else self._supervisor.restarts(name)

    def _wait_ready(self, say: Callable[[str], None]) -> None:
        """Bounded readiness probe of the children (they give no other signal we can wait on).

        Every process has its own check; two more are blamed on the first gateway: every
        worker registered with the scheduler, and /health 200 on the shared HTTP port.
        """
        deadline = time.monotonic() + self.config.startup_timeout_s
        checks = [(s, s.ready, f"{s.name} ready ({s.metrics_url})") for s in self.services]
        first_gateway = self._service(self.gateway_names[0])
        checks.append((first_gateway,
                       workers_registered(self.scheduler_address, set(self.worker_ids)),
                       f"all {len(self.worker_ids)} worker(s) registered"))
        checks.append((first_gateway, http_ok(f"{self.gateway_url}/health"),
                       f"{self.gateway_url}/health answers 200"))
        delay = 0.05
        while checks:
            for entry in list(checks):
                service, check, done = entry
                code = service.exit_code
                if code is not None:
                    raise service.failure(f"exited with code {code} while starting")
                if check():
                    checks.remove(entry)
                    say(done)
            if not checks:
                return
            if time.monotonic() > deadline:
                late = checks[0][0]
                raise late.failure(f"was not healthy within {self.config.startup_timeout_s}s "
                                   f"(waiting on: {', '.join(s.name for s, _, _ in checks)})")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _service(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    def stop(self) -> None:
        """SIGTERM the gateways, then the other services; SIGKILL whatever outlives the grace."""
        self._stopped = True
        if self._supervisor is not None:
            self._supervisor.stop()  # nothing stopped on purpose is started again
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None
        gateway = [s for s in self.services if s.role == "gateway"]
        workers = [s for s in self.services if s.role == "worker"]
        rest = [s for s in self.services if s not in gateway and s not in workers]
        for phase in (gateway, workers, rest):
            terminate(phase, self.config.stop_grace_s)
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._supervisor is not None:
            self._supervisor.finish()

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM (0) or until the stack can no longer serve (1)."""
        signals = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            while not self._fatal.is_set():
                if signal.sigtimedwait(signals, 0.2) is not None:
                    return 0
            return 1
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def start_stack(config: LauncherConfig, *, environ: Mapping[str, str] | None = None,
                say: Callable[[str], None] = lambda _: None) -> Stack:
    """Start the mesh and return it once healthy; use as `with start_stack(...) as stack`."""
    run_dir = Path(config.run_dir) if config.run_dir else Path(
        tempfile.mkdtemp(prefix="meshserve-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    return Stack(config, run_dir, environ).start(say)
