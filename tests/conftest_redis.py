"""Pytest plugin: one real embedded Redis per test session, a clean database per test.

Loaded from tests/conftest.py with `pytest_plugins = ["conftest_redis"]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from meshserve.shared.redis_server import EmbeddedRedis, connect


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """An EmbeddedRedis on 127.0.0.1 and a free port, for the whole session."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def redis_url(redis_server: EmbeddedRedis) -> AsyncIterator[str]:
    """The URL of the session's server, emptied (FLUSHALL) and with scripts dropped."""
    client = connect(redis_server.url)
    try:
        await client.flushall()
        await client.script_flush()
    finally:
        await client.aclose()
    yield redis_server.url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the clean database, closed after the test."""
    client = connect(redis_url)
    yield client
    await client.aclose()
