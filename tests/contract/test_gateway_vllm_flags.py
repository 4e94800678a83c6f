"""vLLM's endpoint flags left at their defaults (the stack test turns them on): no
/tokenizer_info (404), /load at 0, an X-Request-Id only when the caller sent one; and the
flags reaching the gateway from `meshserve up` in vLLM's spelling."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from test_gateway_fakes import MODEL, start_mesh

from meshserve.cli.vllm_options import translate
from meshserve.local.launcher import LauncherConfig, Stack

FLAGS = ["--enable-tokenizer-info-endpoint", "--enable-server-load-tracking",
         "--enable-request-id-headers"]


async def test_the_endpoints_are_as_vllm_leaves_them_by_default() -> None:
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    async with start_mesh() as mesh, aiohttp.ClientSession(mesh.base_url) as http:
        async with http.get("/tokenizer_info") as resp:
            assert resp.status == 404
        async with http.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and "X-Request-Id" not in resp.headers
        async with http.get("/load") as resp:
            assert await resp.json() == {"server_load": 0}  # not counted unless asked
        async with http.get("/ping", headers={"X-Request-Id": "abc"}) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "abc"


def test_up_passes_vllms_flags_to_the_gateway(tmp_path: Path) -> None:
    argv = translate(["m", *FLAGS])
    assert argv == ["m", *FLAGS]  # the same spelling: passed through untouched
    config = LauncherConfig.from_args(["--model", "m", "--device", "cpu", *FLAGS], environ={})
    stack = Stack(config, tmp_path)
    stack.redis_url = "redis://127.0.0.1:1/0"
    stack._plan()
    gateway = next(s for s in stack.services if s.role == "gateway")
    assert all(flag in gateway.argv for flag in FLAGS)


def test_up_passes_enable_prompt_embeds_to_the_gateway_and_workers(tmp_path: Path) -> None:
    config = LauncherConfig.from_args(["--model", "m", "--device", "cpu",
                                       "--enable-prompt-embeds"], environ={})
    stack = Stack(config, tmp_path)
    stack.redis_url = "redis://127.0.0.1:1/0"
    stack._plan()
    for role in ("gateway", "worker"):
        service = next(s for s in stack.services if s.role == role)
        assert "--enable-prompt-embeds" in service.argv, role
