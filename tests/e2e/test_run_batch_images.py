"""`meshserve run-batch` with images: the installed console script on tiny LLaVA,
Qwen2.5-VL and Gemma 3 folders.

Chats with one image and with two (data URLs) answer transformers' greedy tokens on the
same weights and images; a file that is no image, and an http URL on loopback (the SSRF
guard), fail their lines alone with a 400 naming the part; a text chat beside them is
served.
"""

from __future__ import annotations

import base64
import os
import subprocess
from pathlib import Path

import orjson
import pytest
import torch
from openai.types.chat import ChatCompletion
from test_cli import meshserve_script
from tiny_vlm import build_tiny_vlm, load_processor
from transformers import AutoModelForImageTextToText
from vlm_reference import hf_vlm_greedy, image_file, vlm_case

MAX_TOKENS = 6
WIDE, TALL = image_file(80, 60, 31), image_file(40, 90, 32, "JPEG")


def _url(data: bytes) -> str:
    kind = "jpeg" if data[:2] == b"\xff\xd8" else "png"
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def _line(custom_id: str, model: str, content: list[dict[str, object]] | str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST",
                         "url": "/v1/chat/completions", "body": {
                             "model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                             "ignore_eos": True,
                             "messages": [{"role": "user", "content": content}]}})


def _image(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "gemma3"])
def test_run_batch_chats_with_images(family: str, tmp_path: Path) -> None:
    folder = build_tiny_vlm(tmp_path / family, family, seed=13)
    model = str(folder)
    text = {"type": "text", "text": "What is this?"}
    broken = "data:image/png;base64," + base64.b64encode(b"no image here").decode()
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"\n".join([
        _line("one", model, [_image(_url(WIDE)), text]),
        _line("broken", model, [text, _image(broken)]),
        _line("two", model, [_image(_url(TALL)), text, _image(_url(WIDE))]),
        _line("loopback", model, [text, _image("http://127.0.0.1:9/cat.png")]),
        _line("words", model, "Only words here."),
    ]) + b"\n")
    target = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHSERVE_")}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [str(meshserve_script()), "run-batch", "-i", str(source), "-o", str(target),
         "--model", model, "--no-progress", "--dtype", "float32", "--device", "cpu",
         "--num-kv-blocks", "64", "--num-threads", "1"],
        check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "3/5 requests succeeded" in done.stderr
    records = {r["custom_id"]: r["response"] for r in
               (orjson.loads(raw) for raw in target.read_bytes().splitlines())}

    for name, part in (("broken", "messages[0].content[1]"),
                       ("loopback", "messages[0].content[1]")):
        assert records[name]["status_code"] == 400, name
        error = records[name]["body"]["error"]
        assert error["param"] == part, error

    processor = load_processor(folder)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    token = getattr(hf.config, "image_token_id", None) or hf.config.image_token_index
    image = {"type": "image"}
    for name, parts, files in (("one", [image, text], [WIDE]),
                               ("two", [image, text, image], [TALL, WIDE])):
        case = vlm_case(processor, token,
                        [{"role": "user", "content": parts}], files)
        want = processor.tokenizer.decode(hf_vlm_greedy(hf, case, MAX_TOKENS),
                                          skip_special_tokens=True)
        assert records[name]["status_code"] == 200, records[name]
        chat = ChatCompletion.model_validate(records[name]["body"])
        assert chat.choices[0].message.content == want, name
        assert chat.usage is not None and chat.usage.prompt_tokens == len(case.token_ids)
    assert records["words"]["status_code"] == 200
