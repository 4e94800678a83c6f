"""Gateway options: --root-path (the API answers under the prefix and without it, as a
proxy may keep or strip it) and the tool-call / reasoning parser flags."""

from __future__ import annotations

import aiohttp
import pytest
from test_gateway_fakes import MODEL, start_mesh

from meshserve.services.gateway.config import GatewayConfig
from meshserve.shared.errors import ConfigError

BODY = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


async def test_the_api_answers_with_and_without_the_root_path() -> None:
    async with start_mesh(root_path="/llm/v2") as mesh, \
            aiohttp.ClientSession(mesh.base_url) as http:
        for prefix in ("", "/llm/v2"):
            async with http.post(f"{prefix}/v1/chat/completions", json=BODY) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["object"] == "chat.completion"
            async with http.get(f"{prefix}/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with http.get("/other/v1/models") as resp:
            assert resp.status == 404


@pytest.mark.parametrize("root_path", ["llm", "/llm/"])
def test_a_root_path_must_be_a_clean_prefix(root_path: str) -> None:
    with pytest.raises(ConfigError, match="root_path|root-path"):
        GatewayConfig(root_path=root_path)


@pytest.mark.parametrize(("settings", "words"), [
    ({"tool_call_parser": "nope"}, "hermes"),
    ({"reasoning_parser": "nope"}, "deepseek_r1"),
    ({"enable_auto_tool_choice": True}, "tool-call-parser"),
])
def test_parser_flags_are_checked(settings: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        GatewayConfig(**settings)  # type: ignore[arg-type]
    GatewayConfig(tool_call_parser="qwen3_coder", enable_auto_tool_choice=True,
                  reasoning_parser="qwen3")
