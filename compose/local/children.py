"""The children `meshserve up` starts: a service process (how it starts, its log, its
environment) and the embedded Redis, as the supervisor watches and restarts them."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from meshserve.shared.config import ENV_PREFIX, Config
from meshserve.shared.errors import UnavailableError
from meshserve.shared.redis_server import EmbeddedRedis
from meshserve.shared.service_main import PARENT_PID_ENV

_LOG_TAIL_LINES = 40
_CONFIG_CLASSES = {"tokenizer": "TokenizerConfig", "scheduler": "SchedulerConfig",
                   "kvstore": "KVStoreConfig", "worker": "WorkerConfig",
                   "gateway": "GatewayConfig", "encoder": "EncoderConfig"}


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
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def start(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        # The child stops when this process's starting thread does (shared/service_main.py).
        env_of_child = {**env, PARENT_PID_ENV: str(os.getpid())}
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", f"meshserve.services.{self.role}", *self.argv],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env_of_child,
                start_new_session=True)  # Ctrl-C reaches the launcher only; it stops us in order

    def restart(self) -> None:
        """Start it again the same way (the supervisor's call, after it died)."""
        self.start(self.env)

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


@dataclasses.dataclass
class RedisChild:
    """The embedded Redis, as a child the supervisor can watch and restart."""

    server: EmbeddedRedis
    name: str = "redis"
    role: str = "redis"

    @property
    def exit_code(self) -> int | None:
        return self.server.exit_code

    def restart(self) -> None:
        self.server.restart()

    def ready(self) -> bool:
        return self.server.answers()

    def log_tail(self) -> str:
        return self.server.log_tail()


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
    # Each child gets --metrics-port of its own; the shared variable is the launcher's base.
    env.pop(f"{ENV_PREFIX}METRICS_PORT", None)
    return env


def terminate(services: list[ServiceProcess], grace_s: float) -> None:
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
