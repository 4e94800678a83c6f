"""Loading and unloading LoRA adapters at runtime, from the worker's gRPC edge.

Reading an adapter (disk, safetensors, checks) runs in a thread of its own so that the event
loop keeps serving; the engine thread only ever sees adapters that are complete. After each
change the worker's description (WorkerInfo's lora_ids and lora_names) is rebuilt and handed
to `on_change`, which re-registers the worker so that the scheduler routes by it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from meshserve.services.worker.lora.manager import LoraManager
from meshserve.shared.errors import InvalidRequestError
from meshserve.shared.lora_config import LoraModule
from meshserve.shared.worker_registry import WorkerInfo


def with_loras(info: WorkerInfo, manager: LoraManager | None) -> WorkerInfo:
    """`info` listing the adapters `manager` serves now."""
    modules = manager.served() if manager is not None else []
    return replace(info, lora_ids=tuple(m.lora_id for m in modules),
                   lora_names=tuple(m.name for m in modules))


class LoraControl:
    """The Load/UnloadLoraAdapter RPCs' logic over the engine's LoraManager."""

    def __init__(self, manager: LoraManager | None,
                 on_change: Callable[[Callable[[WorkerInfo], WorkerInfo]], Awaitable[None]]
                 ) -> None:
        """`on_change(update)`: apply `update` to the worker's info and announce it."""
        self._manager = manager
        self._on_change = on_change
        self._lock = asyncio.Lock()  # one change at a time, announced in order

    def _require(self) -> LoraManager:
        if self._manager is None:
            raise InvalidRequestError("LoRA adapters are not enabled on this worker (start it "
                                      "with --enable-lora)", param="lora_name")
        return self._manager

    async def load(self, name: str, path: str) -> int:
        """Serve the adapter at `path` as `name`; returns its id."""
        manager = self._require()
        if not name or not path:
            raise InvalidRequestError("both lora_name and lora_path are required",
                                      param="lora_name" if not name else "lora_path")
        module = LoraModule(name, path)
        async with self._lock:
            await asyncio.to_thread(manager.add, module)
            await self._on_change(lambda info: with_loras(info, manager))
        return module.lora_id

    async def unload(self, name: str) -> int:
        """Stop serving the adapter `name`; returns the id it had."""
        manager = self._require()
        async with self._lock:
            module = await asyncio.to_thread(manager.remove, name)
            await self._on_change(lambda info: with_loras(info, manager))
        return module.lora_id
