"""Contract tests of the embedded Redis server process (shared/redis_server.py)."""

from __future__ import annotations

import pytest

from meshserve.shared.errors import UnavailableError
from meshserve.shared.redis_server import EmbeddedRedis, connect, find_free_port, wait_for_redis


async def test_server_answers_and_stops() -> None:
    server = EmbeddedRedis()
    with pytest.raises(UnavailableError):
        _ = server.url  # not started
    with server:
        assert server.running
        client = connect(server.url)
        assert await client.ping()
        assert await client.config_get("save") == {"save": ""}  # no persistence
        assert await client.config_get("appendonly") == {"appendonly": "no"}
        await client.aclose()
    assert not server.running
    server.stop()  # idempotent


async def test_failed_start_reports_the_server_output(redis_server: EmbeddedRedis) -> None:
    taken = EmbeddedRedis(port=redis_server.port or 0, startup_timeout_s=5)
    with pytest.raises(UnavailableError, match="in use"):
        taken.start()
    assert not taken.running
    bad = EmbeddedRedis(extra_args=["--maxmemory-policy", "no-such-policy"])
    with pytest.raises(UnavailableError, match="no-such-policy"):
        bad.start()


async def test_wait_for_redis_gives_up_in_bounded_time() -> None:
    client = connect(f"redis://127.0.0.1:{find_free_port()}/0", timeout_s=0.2)
    with pytest.raises(UnavailableError, match="within 0.3s"):
        await wait_for_redis(client, timeout_s=0.3)
    await client.aclose()
