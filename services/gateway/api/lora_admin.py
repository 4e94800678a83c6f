"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

    {"lora_name": "sql", "lora_path": "/adapters/sql"}   -> every generation worker loads it
    {"lora_name": "sql"}                                 -> every worker that has it unloads it

As in vLLM they answer only when runtime updating is allowed (VLLM_ALLOW_RUNTIME_LORA_UPDATING
or --allow-runtime-lora-updating): the path is read on the workers' file systems. A load
reaches every registered generation worker (of `base_model_name` when the body names one),
all at once; if any refuses, those that took it unload it again and the request fails with
that worker's error (404 no adapter at the path, 400 an adapter the model cannot run), so
that an adapter is served by every worker of its model or by none. The worker list is then
refreshed, so that the adapter is in /v1/models and takes requests at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from meshserve.proto.v1 import worker_pb2
from meshserve.services.gateway.api.handlers import read_json
from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.links.clients import MeshClients, WorkerEntry
from meshserve.shared.errors import InvalidRequestError, MeshError, NotFoundError
from meshserve.shared.grpc_client import mesh_errors

_log = logging.getLogger(__name__)


class LoraAdmin:
    """Handlers of the two runtime LoRA endpoints."""

    def __init__(self, config: GatewayConfig, clients: MeshClients) -> None:
        self._config = config
        self._clients = clients
        self._lock = asyncio.Lock()  # one change at a time from this gateway

    async def load(self, request: web.Request) -> web.Response:
        """POST /v1/load_lora_adapter."""
        body = await self._body(request)
        name, path = _text(body, "lora_name"), _text(body, "lora_path")
        base = body.get("base_model_name")
        async with self._lock:
            workers = await self._clients.list_workers(refresh=True)
            if any(w.serves(name) for w in workers):
                raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.",
                                          param="lora_name")
            targets = [w for w in workers if w.generates
                       and (not isinstance(base, str) or base in w.model_names)]
            if not targets:
                raise NotFoundError("no generation worker is registered"
                                    + (f" for model {base!r}" if isinstance(base, str) else ""),
                                    param="base_model_name")
            message = worker_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
            results = await asyncio.gather(*(self._call(w, "LoadLoraAdapter", message)
                                             for w in targets), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                await self._undo(name, [w for w, r in zip(targets, results, strict=True)
                                        if not isinstance(r, BaseException)])
                raise failed[0]
            await self._clients.list_workers(refresh=True)
        _log.info("LoRA adapter %s loaded from %s on %d worker(s)", name, path, len(targets))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """POST /v1/unload_lora_adapter."""
        body = await self._body(request)
        name = _text(body, "lora_name")
        async with self._lock:
            workers = [w for w in await self._clients.list_workers(refresh=True)
                       if any(a.name == name for a in w.loras)]
            if not workers:
                raise NotFoundError(f"The lora adapter '{name}' cannot be found.",
                                    param="lora_name")
            message = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
            await asyncio.gather(*(self._call(w, "UnloadLoraAdapter", message)
                                   for w in workers))
            await self._clients.list_workers(refresh=True)
        _log.info("LoRA adapter %s unloaded from %d worker(s)", name, len(workers))
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not self._config.allow_runtime_lora_updating:
            raise NotFoundError("loading and unloading LoRA adapters at runtime is off (set "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true or start the gateway "
                                "with --allow-runtime-lora-updating)", param="path")
        return await read_json(request)

    async def _call(self, worker: WorkerEntry, method: str, message: Any) -> Any:
        stub = self._clients.worker(worker.address)
        with mesh_errors():
            return await getattr(stub, method)(message, timeout=self._config.request_timeout_s)

    async def _undo(self, name: str, workers: list[WorkerEntry]) -> None:
        """Unload `name` from the workers that loaded it before another refused it."""
        message = worker_pb2.UnloadLoraAdapterRequest(lora_name=name)
        results = await asyncio.gather(*(self._call(w, "UnloadLoraAdapter", message)
                                         for w in workers), return_exceptions=True)
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, MeshError):
                _log.warning("could not unload LoRA adapter %s from %s after a failed load: %s",
                             name, worker.worker_id, result.message)


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{key}' (a non-empty string) is required", param=key)
    return value
