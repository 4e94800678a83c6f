"""The runtime LoRA endpoints of the gateway (over fake services): off unless allowed, as in
vLLM, with a 404 that says how to turn them on; a body without a name is a 400."""

from __future__ import annotations

import aiohttp
from test_gateway_fakes import start_mesh


async def test_runtime_lora_updating_is_off_unless_allowed() -> None:
    async with start_mesh() as mesh, aiohttp.ClientSession(mesh.base_url) as http:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            async with http.post(path, json={"lora_name": "a", "lora_path": "/a"}) as resp:
                assert resp.status == 404
                error = (await resp.json())["error"]
                assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in error["message"]
    assert mesh.worker.requests == []


async def test_a_load_without_a_name_or_path_is_a_400() -> None:
    async with start_mesh(allow_runtime_lora_updating=True) as mesh, \
            aiohttp.ClientSession(mesh.base_url) as http:
        for body in ({"lora_path": "/a"}, {"lora_name": "a"}, {"lora_name": "", "lora_path": 3}):
            async with http.post("/v1/load_lora_adapter", json=body) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["param"] in ("lora_name", "lora_path")
        async with http.post("/v1/unload_lora_adapter", json={"lora_name": "none"}) as resp:
            assert resp.status == 404 and "cannot be found" in (await resp.json())["error"][
                "message"]
