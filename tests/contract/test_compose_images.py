"""The images' build files and the health check they carry.

- compose/Dockerfile: two stages (a build stage makes /opt/venv; the runtime stage copies
  it into the bare base), torch's CPU build, the base image an ARG.
- compose/Dockerfile.cuda: torch and Triton pinned as the pair torch requires.
- compose/healthcheck.sh (`meshserve-health` in the images): run here for real, with bash,
  against a real /health endpoint and a real Redis.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from meshserve.shared.redis_server import EmbeddedRedis
from meshserve.shared.telemetry import Telemetry

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
CHECK = COMPOSE / "healthcheck.sh"


def stages(dockerfile: Path) -> list[str]:
    """The text of each build stage, in order."""
    return re.split(r"^FROM ", dockerfile.read_text(), flags=re.MULTILINE)[1:]


def test_the_cpu_image_is_built_in_one_stage_and_run_from_a_slim_one() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.1[12]-slim$", text, flags=re.MULTILINE)
    build, runtime = stages(COMPOSE / "Dockerfile")
    assert build.startswith("${BASE_IMAGE} AS build")
    assert runtime.startswith("${BASE_IMAGE} AS runtime")
    # torch's CPU build, pinned by its +cpu local version.
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in build
    assert '"torch==${TORCH_VERSION}+cpu"' in build
    assert "pip install --no-deps ." in build
    # The runtime stage installs nothing: it copies the environment and the model cache.
    assert "pip" not in runtime and "apt-get" not in runtime
    copies = re.findall(r"^COPY --from=build (?:--chown=meshserve )?(\S+)", runtime,
                        flags=re.MULTILINE)
    assert copies == ["/opt/venv", "/opt/meshserve-cache"]
    assert "USER meshserve" in runtime


def test_the_cuda_image_pins_torch_and_its_triton() -> None:
    text = (COMPOSE / "Dockerfile.cuda").read_text()
    assert "ARG TORCH_VERSION=2.11.0" in text
    assert "ARG TRITON_VERSION=3.6.0" in text  # torch 2.11.0 requires triton==3.6.0
    assert text.count('"torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"') == 2
    assert len(stages(COMPOSE / "Dockerfile.cuda")) == 2


def test_both_build_contexts_admit_the_health_check() -> None:
    for name in ("Dockerfile.dockerignore", "Dockerfile.cuda.dockerignore"):
        assert "!compose/healthcheck.sh" in (COMPOSE / name).read_text().splitlines(), name
    for name in ("Dockerfile", "Dockerfile.cuda"):
        assert "COPY compose/healthcheck.sh /opt/venv/bin/meshserve-health" in \
            (COMPOSE / name).read_text(), name


async def run_check(*args: str, env: dict[str, str] | None = None) -> int:
    process = await asyncio.create_subprocess_exec(
        "bash", str(CHECK), *args, env={"PATH": "/usr/bin:/bin", **(env or {})},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), timeout=10)


async def test_the_health_check_follows_the_health_endpoint() -> None:
    telemetry = Telemetry("test")
    runner = await telemetry.start_metrics_server("127.0.0.1", 0)
    port = str(runner.addresses[0][1])
    try:
        assert await run_check(port) == 1  # STARTING: 503
        serving = [True]
        telemetry.health.attach(lambda: serving[0])
        assert await run_check(port) == 0
        # The port from the service's own environment, as in the compose file.
        assert await run_check(env={"MESHSERVE_METRICS_PORT": port}) == 0
        serving[0] = False
        assert await run_check(port) == 1
        assert await run_check() == 1  # no port at all
    finally:
        await runner.cleanup()
    assert await run_check(port) == 1  # nothing listens


async def test_the_health_check_pings_redis(redis_server: EmbeddedRedis) -> None:
    assert await run_check("redis", str(redis_server.port)) == 0
    telemetry = Telemetry("test")
    runner = await telemetry.start_metrics_server("127.0.0.1", 0)
    try:  # an HTTP server is not Redis
        assert await run_check("redis", str(runner.addresses[0][1])) == 1
    finally:
        await runner.cleanup()
