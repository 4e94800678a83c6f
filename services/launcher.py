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
SIGTERM to the gateways first, then to the rest, and SIGKILL after `--stop-grace-s`; a
child that dies on its own stops the whole stack.

`--gateways N` (N > 1) starts N gateway processes, gateway-0..N-1, on the same host:port
with SO_REUSEPORT: the kernel spreads new connections over them, and each keeps its own
channels and sessions to the other services. A lone gateway is named `gateway` and
listens without SO_REUSEPORT, so that a taken port is an error rather than shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from meshserve.services.launcher_probes import (
    grpc_serving,
    http_ok,
    metric_is,
    port_taken,
    workers_registered,
)
from meshserve.services.worker.config import EngineOptions
from meshserve.shared.config import ENV_PREFIX, Config, option
from meshserve.shared.errors import ConfigError, MeshError, UnavailableError
from meshserve.shared.redis_server import EmbeddedRedis, find_free_port

_LOOPBACK = "127.0.0.1"
# --gateways 0: one gateway per this many cores, at most this many gateways.
_CORES_PER_GATEWAY = 8
_MAX_AUTO_GATEWAYS = 4
_LOG_TAIL_LINES = 40
_GATEWAY_LISTENING = "meshserve_gateway_http_listening 1.0"  # a sample of its /metrics
_CONFIG_CLASSES = {"tokenizer": "TokenizerConfig", "scheduler": "SchedulerConfig",
                   "kvstore": "KVStoreConfig", "worker": "WorkerConfig",
                   "gateway": "GatewayConfig"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LauncherConfig(EngineOptions):
    """The whole mesh on this machine; engine options go to every worker."""

    workers: int = option(1, "model workers to start")
    tokenizers: int = option(1, "tokenizer replicas to start")
    gateways: int = option(1, "gateway processes sharing the HTTP port (SO_REUSEPORT when "
                              "more than 1); 0: one per 8 CPU cores, from 1 to 4")
    kvstore: bool = option(True, "start the KV-cache store")
    host: str = option(_LOOPBACK, "address the gateway listens on (0.0.0.0: all interfaces)")
    port: int = option(8000, "HTTP port of the gateway (0: any free port)")
    redis_url: str | None = option(None, "external Redis (unset: start an embedded one)")
    api_key: str | None = option(None, "Bearer token clients must send to the gateway (unset: "
                                       "no auth)")
    served_model_name: str | None = option(None, "name clients use for the model (unset: the "
                                                 "--model value)")
    run_dir: str | None = option(None, "folder for the services' logs (unset: a new "
                                       "temporary folder)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = option("INFO", "services' "
                                                                             "log level")
    otlp_endpoint: str | None = option(None, "OTLP gRPC endpoint for every service's traces",
                                       env="OTEL_EXPORTER_OTLP_ENDPOINT")
    startup_timeout_s: float = option(600.0, "how long the services may take to be healthy")
    stop_grace_s: float = option(30.0, "how long services may drain before SIGKILL")

    @property
    def num_gateways(self) -> int:
        """Gateway processes to start: --gateways, or by cores when it is 0. One gateway is
        one event-loop thread; past a few hundred concurrent streams (or a burst of
        requests arriving at once) one core no longer keeps up (docs/scaling.md)."""
        if self.gateways:
            return self.gateways
        return min(max((os.cpu_count() or 1) // _CORES_PER_GATEWAY, 1), _MAX_AUTO_GATEWAYS)

    def validate(self) -> None:
        super().validate()
        for name in ("workers", "tokenizers"):
            value = getattr(self, name)
            self.require(value >= 1, f"must be at least 1, got {value}", name)
        self.require(self.gateways >= 0, f"must be >= 0 (0: by cores), got {self.gateways}",
                     "gateways")
        self.require(0 <= self.port <= 65535, f"must be in [0, 65535], got {self.port}", "port")
        for name in ("startup_timeout_s", "stop_grace_s"):
            value = getattr(self, name)
            self.require(value > 0, f"must be positive, got {value}", name)


@dataclasses.dataclass
class ServiceProcess:
    """One child service: how to start it, where it logs, how to tell it is ready."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    metrics_url: str  # its own Prometheus endpoint (--metrics-port)
    process: subprocess.Popen[bytes] | None = None

    def start(self, env: Mapping[str, str]) -> None:
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", f"meshserve.services.{self.role}", *self.argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops us in order
                preexec_fn=_die_with_parent)  # noqa: PLW1509 (only prctl, before exec)

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(empty log)"

    def failure(self, why: str) -> UnavailableError:
        return UnavailableError(f"{self.name} {why}; last lines of {self.log_path}:\n"
                                f"{self.log_tail()}", param=self.name)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher's thread exits (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes  # only in the forked child

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def child_env(role: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child: MESHSERVE_* variables its own config does not know are
    left out (each service refuses unknown ones; the launcher passes flags instead)."""
    config_cls: type[Config] = getattr(
        importlib.import_module(f"meshserve.services.{role}.config"), _CONFIG_CLASSES[role])
    known = {name for f in dataclasses.fields(config_cls) for name in config_cls.env_names(f)}
    env = {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX) or k in known}
    # The services share the machine: idle OpenMP threads must sleep, not spin, or they take
    # the cores that the worker's engine and the other services need (on 2 cores, spinning
    # cost the mesh a third of its throughput).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _worker_devices(config: LauncherConfig) -> list[list[str]]:
    """Per-worker flags placing workers: a GPU each (round-robin), or a share of the CPU."""
    count = 0
    if config.device in ("auto", "cuda"):
        import torch  # only to count GPUs (slow to import)

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count:
        per_gpu = -(-config.workers // count)
        share = [] if per_gpu == 1 else ["--gpu-memory-utilization",
                                         f"{config.gpu_memory_utilization / per_gpu:.3f}"]
        return [["--device", f"cuda:{i % count}", *share] for i in range(config.workers)]
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // config.workers)
    return [["--num-threads", str(threads)] for _ in range(config.workers)]


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
        port = config.port or find_free_port(_LOOPBACK)
        shown = _LOOPBACK if config.host in ("0.0.0.0", "::", "") else config.host
        self._gateway_host = shown
        self.gateway_url = f"http://{shown}:{port}"
        self.gateway_port = port
        self.tokenizer_addresses = [self._free() for _ in range(config.tokenizers)]
        self.scheduler_address = self._free()
        self.kvstore_address = self._free() if config.kvstore else None
        self.worker_addresses = [self._free() for _ in range(config.workers)]
        self.worker_ids = [f"worker-{i}" for i in range(config.workers)]
        self.gateway_names = (["gateway"] if config.num_gateways == 1 else
                              [f"gateway-{i}" for i in range(config.num_gateways)])

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

    @staticmethod
    def _free() -> str:
        return f"{_LOOPBACK}:{find_free_port(_LOOPBACK)}"

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
                                             "--block-size", str(c.block_size)],
                  grpc_serving(self.scheduler_address))
        if self.kvstore_address is not None:
            self._add("kvstore", "kvstore", [*self._common(self.kvstore_address),
                                             "--redis-url", self.redis_url],
                      grpc_serving(self.kvstore_address))
        served = ["--served-model-names", c.served_model_name] if c.served_model_name else []
        for worker_id, address, placement in zip(self.worker_ids, self.worker_addresses,
                                                 _worker_devices(c), strict=True):
            self._add(worker_id, "worker", [
                *self._common(address), "--worker-id", worker_id, "--redis-url", self.redis_url,
                "--scheduler-address", self.scheduler_address, *served,
                *c.engine_flags(), *placement], grpc_serving(address))
        gateway = [*self._common(), "--host", c.host, "--port", str(self.gateway_port),
                   "--tokenizer-addresses", ",".join(self.tokenizer_addresses),
                   "--scheduler-address", self.scheduler_address]
        if c.served_model_name:
            gateway += ["--served-model-names", c.served_model_name]
        if c.api_key:
            gateway += ["--api-key", c.api_key]
        if c.num_gateways > 1:
            gateway.append("--reuse-port")
        for name in self.gateway_names:
            # Its own /metrics is the one probe that reaches this process and no other.
            metrics_port = find_free_port(_LOOPBACK)
            metrics_url = f"http://{self._gateway_host}:{metrics_port}/metrics"
            self._add(name, "gateway", gateway, metric_is(metrics_url, _GATEWAY_LISTENING),
                      metrics_port, self._gateway_host)

    def _add(self, name: str, role: str, argv: list[str], ready: Callable[[], bool],
             metrics_port: int | None = None, metrics_host: str = _LOOPBACK) -> None:
        """Plan one child, with a /metrics port of its own (a free one unless given)."""
        metrics_port = metrics_port or find_free_port(_LOOPBACK)
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
                self._redis = EmbeddedRedis().start()
                self.redis_url = self._redis.url
                say(f"embedded Redis at {self.redis_url}")
            self._plan()
            for service in self.services:
                service.start(child_env(service.role, self._environ))
                say(f"started {service.name} (log {service.log_path})")
            self._wait_ready(say)
        except BaseException:
            self.stop()
            raise
        return self

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

    def dead_services(self) -> list[ServiceProcess]:
        """Children that have exited."""
        return [s for s in self.services if s.process is not None and s.exit_code is not None]

    def stop(self) -> None:
        """SIGTERM the gateways, then the other services; SIGKILL whatever outlives the grace."""
        gateway = [s for s in self.services if s.role == "gateway"]
        workers = [s for s in self.services if s.role == "worker"]
        rest = [s for s in self.services if s not in gateway and s not in workers]
        for phase in (gateway, workers, rest):
            _terminate(phase, self.config.stop_grace_s)
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM (0) or until a service dies on its own (1)."""
        signals = {signal.SIGINT, signal.SIGTERM, signal.SIGCHLD}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            while True:
                dead = self.dead_services()
                if dead:
                    for service in dead:
                        print(service.failure(f"exited with code {service.exit_code}").message,
                              file=sys.stderr)
                    return 1
                if signal.sigwaitinfo(signals).si_signo != signal.SIGCHLD:
                    return 0
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _terminate(services: list[ServiceProcess], grace_s: float) -> None:
    running = [s.process for s in services if s.process is not None and s.process.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_stack(config: LauncherConfig, *, environ: Mapping[str, str] | None = None,
                say: Callable[[str], None] = lambda _: None) -> Stack:
    """Start the mesh and return it once healthy; use as `with start_stack(...) as stack`."""
    run_dir = Path(config.run_dir) if config.run_dir else Path(
        tempfile.mkdtemp(prefix="meshserve-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    return Stack(config, run_dir, environ).start(say)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While starting, SIGTERM unwinds like Ctrl-C so that started children are stopped."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """`meshserve up`: start the stack, print the gateway URL, run until Ctrl-C/SIGTERM."""
    try:
        config = LauncherConfig.from_args(argv, strict_env=False, prog="meshserve up")
    except ConfigError as exc:
        print(f"meshserve up: {exc.message}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(f"meshserve up: {line}", file=sys.stderr, flush=True)

    try:
        with _sigterm_as_exit():
            stack = start_stack(config, say=say)
    except MeshError as exc:
        say(f"failed: {exc.message}")
        return 1
    except KeyboardInterrupt:
        say("interrupted while starting; stopped")
        return 130
    with stack:
        model = ", ".join(stack.model_names())
        print(f"meshserve is up: {stack.base_url} (model {model}, {config.workers} "
              f"worker(s), {config.num_gateways} gateway(s)); logs in {stack.run_dir}; "
              f"Ctrl-C stops", flush=True)
        code = stack.wait()
        say("stopping" if code == 0 else "a service died; stopping everything")
    return code
