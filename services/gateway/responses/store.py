"""Stored /v1/responses answers: the response object and the conversation that continues it.

    store = ResponseStore(redis_url, ttl_s)
    await store.put(response, messages, items)  # unless the request said store: false
    stored = await store.get(response_id)   # {"response", "messages", "input_items"}, or 404
    await store.delete(response_id)

In Redis when the gateway has one (`--redis-url`; `meshserve up` and the compose stack
give it theirs), so that every gateway replica finds every answer: one key per response,
`ms:resp:<id>`, expiring after `ttl_s`. Without Redis they are kept in this process, at
most `LOCAL_CAPACITY` of them (the oldest forgotten first), which suits one gateway only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import orjson
import redis.exceptions

from meshserve.shared.errors import NotFoundError, UnavailableError
from meshserve.shared.redis_server import connect

KEY_PREFIX = "ms:resp:"
# Bounds the memory of a gateway without Redis: each entry holds a whole conversation.
LOCAL_CAPACITY = 10_000


def response_key(response_id: str) -> str:
    return KEY_PREFIX + response_id


class ResponseStore:
    """Stored responses, each kept for `ttl_s` (see the module doc)."""

    def __init__(self, redis_url: str | None, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._redis = connect(redis_url, client_name="meshserve-gateway") if redis_url \
            else None
        self._local: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    async def put(self, response: dict[str, Any], messages: list[dict[str, Any]],
                  input_items: list[dict[str, Any]]) -> None:
        """Keep `response`, the conversation `messages` that a continuation starts from, and
        the request's `input_items` as GET .../input_items lists them."""
        key = response_key(response["id"])
        value = orjson.dumps({"response": response, "messages": messages,
                              "input_items": input_items})
        if self._redis is None:
            self._local[key] = (time.monotonic() + self.ttl_s, value)
            while len(self._local) > LOCAL_CAPACITY:
                self._local.popitem(last=False)
            return
        await self._call(self._redis.set(key, value, px=max(1, int(self.ttl_s * 1000))))

    async def get(self, response_id: str, param: str = "response_id") -> dict[str, Any]:
        """The stored response and conversation; NotFoundError (404) naming `param` when it
        is unknown or expired."""
        key = response_key(response_id)
        if self._redis is None:
            entry = self._local.get(key)
            value = entry[1] if entry and entry[0] > time.monotonic() else None
        else:
            value = await self._call(self._redis.get(key))
        if value is None:
            raise _not_found(response_id, param)
        stored: dict[str, Any] = orjson.loads(value)
        return stored

    async def delete(self, response_id: str) -> None:
        """Forget a stored response; NotFoundError (404) when there is none."""
        key = response_key(response_id)
        if self._redis is None:
            entry = self._local.pop(key, None)
            found = entry is not None and entry[0] > time.monotonic()
        else:
            found = bool(await self._call(self._redis.delete(key)))
        if not found:
            raise _not_found(response_id, "response_id")

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    @staticmethod
    async def _call(command: Any) -> Any:
        """A Redis command's result; UnavailableError (503) when Redis cannot be reached."""
        try:
            return await command
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise UnavailableError(f"the response store (Redis) is unreachable: {exc}") from exc


def _not_found(response_id: str, param: str) -> NotFoundError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return NotFoundError(f"{what} with id '{response_id}' not found.", param=param)
