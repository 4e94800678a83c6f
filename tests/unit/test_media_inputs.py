"""Image inputs before any fetch: image parts read as vLLM reads them, data URLs, the
per-prompt limit flag, and decoding with Pillow (whole images only, a pixel cap)."""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

import pytest
from PIL import Image

from meshserve.services.gateway.config import GatewayConfig
from meshserve.services.gateway.media.data_url import parse_data_url
from meshserve.services.gateway.media.decode import decode_image
from meshserve.services.gateway.media.parts import ImageRef, split_images
from meshserve.services.gateway.media.policy import ImageRefused, parse_limit_mm_per_prompt
from meshserve.shared.errors import ConfigError, InvalidRequestError


def encoded(fmt: str, size: tuple[int, int] = (6, 4), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, (200, 30, 60) if mode == "RGB" else 7).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# -- image parts ----------------------------------------------------------------------------

def test_image_parts_become_image_placeholders_in_order() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "https://a.test/1.png", "detail": "low"}},
            {"type": "image_url", "image_url": "https://a.test/2.png"},
            {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"image_url": {"url": "data:image/png;base64,AA=="}},
                                     {"image_url": "https://a.test/4.png"},
                                     {"type": "input_image", "image_url": "https://a.test/5"}]}]
    result, images = split_images(messages)
    assert [i.where for i in images] == [
        "messages[1].content[1]", "messages[1].content[2]", "messages[3].content[0]",
        "messages[3].content[1]", "messages[3].content[2]"]
    assert [i.url for i in images] == [
        "https://a.test/1.png", "https://a.test/2.png", "data:image/png;base64,AA==",
        "https://a.test/4.png", "https://a.test/5"]
    image = {"type": "image"}
    assert result == (
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "compare"}, image, image,
                                     {"type": "text", "text": "and"}]},
        messages[2],
        {"role": "user", "content": [image, image, image]})
    assert messages[1]["content"][1]["type"] == "image_url"  # the request is not changed


def test_a_conversation_without_images_is_unchanged() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": []}]
    result, images = split_images(messages)
    assert images == ()
    assert all(a is b for a, b in zip(result, messages, strict=True))  # not even copied


@pytest.mark.parametrize(("part", "words"), [
    ({"type": "image_url", "image_url": {"detail": "auto"}}, "needs a URL"),
    ({"type": "image_url"}, "needs a URL"),
    ({"type": "image_url", "image_url": {"url": ""}}, "needs a URL"),
    ({"type": "image_url", "image_url": {"url": "https://a", "detail": "max"}},
     "detail must be one of auto, low, high"),
    ({"type": "image_url", "image_url": {"url": "https://a"}, "uuid": "u1"}, "'uuid'"),
    ({"type": "input_image", "file_id": "f1"}, "file_id is not supported"),
    ({"type": "image"}, "carries no image"),
    ({"type": "video_url", "video_url": {"url": "https://a.mp4"}}, "video ('video_url' parts)"),
    ({"type": "input_audio", "input_audio": {}}, "audio ('input_audio' parts)"),
])
def test_bad_image_parts_are_named(part: dict[str, Any], words: str) -> None:
    messages = [{"role": "user", "content": "x"},
                {"role": "user", "content": [{"type": "text", "text": "see"}, part]}]
    with pytest.raises(InvalidRequestError) as refused:
        split_images(messages)
    assert refused.value.param == "messages[1].content[1]"
    assert refused.value.message.startswith("messages[1].content[1]: ")
    assert words in refused.value.message


def test_a_data_url_is_shown_without_its_payload() -> None:
    assert ImageRef("w", "data:image/png;base64,AAAA").shown == "data:image/png;base64,..."
    assert ImageRef("w", "https://a.test/" + "x" * 200).shown.endswith("x...")
    assert len(ImageRef("w", "https://a.test/" + "x" * 200).shown) == 120


# -- data URLs ------------------------------------------------------------------------------

def test_a_data_url_gives_its_bytes() -> None:
    png = encoded("PNG")
    assert parse_data_url(data_url(png), 10**6) == png
    assert parse_data_url(data_url(png, "IMAGE/JPEG;charset=x;BASE64"), 10**6) == png


@pytest.mark.parametrize(("url", "reason", "words"), [
    ("data:image/png;base64", "bad_data_url", "no ','"),
    ("data:text/plain;base64,aGk=", "bad_data_url", "must be image/"),
    ("data:;base64,aGk=", "bad_data_url", "got 'none'"),
    ("data:image/png,rawbytes", "bad_data_url", "only base64"),
    ("data:image/png;base64,not base64!", "bad_data_url", "not valid base64"),
    ("data:image/png;base64,", "bad_data_url", "no data"),
    ("data:image/png;base64," + "A" * 20, "too_large", "is 15 bytes, more than the 10"),
])
def test_bad_data_urls_say_why(url: str, reason: str, words: str) -> None:
    with pytest.raises(ImageRefused) as refused:
        parse_data_url(url, 10)
    assert refused.value.reason == reason
    assert words in refused.value.message


def test_the_size_cap_counts_padding() -> None:
    payload = base64.b64encode(b"x" * 10).decode()  # 16 characters, 2 of them padding
    assert parse_data_url("data:image/png;base64," + payload, 10) == b"x" * 10
    with pytest.raises(ImageRefused, match="11 bytes"):
        parse_data_url("data:image/png;base64," + base64.b64encode(b"x" * 11).decode(), 10)


# -- --limit-mm-per-prompt ------------------------------------------------------------------

@pytest.mark.parametrize(("text", "limits"), [
    ("", {}),
    ('{"image": 4}', {"image": 4}),
    ('{"image": 0, "video": 2}', {"image": 0, "video": 2}),
    ('{"image": {"count": 3, "width": 512, "height": 512}}', {"image": 3}),
    ('{"video": {"count": 1, "num_frames": 32}}', {"video": 1}),
    ("image=2,video=0", {"image": 2, "video": 0}),
])
def test_limit_mm_per_prompt_takes_vllms_forms(text: str, limits: dict[str, int]) -> None:
    assert parse_limit_mm_per_prompt(text) == limits


@pytest.mark.parametrize(("text", "words"), [
    ("{image: 4}", "not valid JSON"), ("[1]", "must be a JSON object"),
    ('{"images": 4}', "unknown modality 'images'"), ('{"image": -1}', "integer >= 0"),
    ('{"image": true}', "integer >= 0"), ('{"image": {"count": 2, "fps": 3}}', "unknown keys fps"),
    ('{"image": {"width": 0}}', "positive integer"), ("image=four", "modality=count"),
])
def test_bad_limits_are_config_errors(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_limit_mm_per_prompt(text)
    with pytest.raises(ConfigError):
        GatewayConfig(limit_mm_per_prompt=text)


def test_the_gateway_config_gives_the_media_settings() -> None:
    assert GatewayConfig().media.max_images == 999  # vLLM's default
    media = GatewayConfig(limit_mm_per_prompt='{"video": 0}', media_max_redirects=2,
                          allowed_media_domains=("Images.Example.COM.", "cdn.test"),
                          allowed_media_networks=("10.0.0.0/8",)).media
    assert media.max_images == 999 and media.max_redirects == 2
    assert media.allowed_domains == {"images.example.com", "cdn.test"}
    assert [str(n) for n in media.allowed_networks] == ["10.0.0.0/8"]
    for bad in ({"media_max_bytes": 0}, {"media_fetch_timeout_s": 0.0},
                {"media_max_redirects": -1}, {"allowed_media_networks": ("x",)}):
        with pytest.raises(ConfigError):
            GatewayConfig(**bad)


# -- decoding -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_supported_formats_decode_with_their_size_and_hash(fmt: str) -> None:
    data = encoded(fmt, (7, 3), "P" if fmt == "GIF" else "RGB")
    decoded = decode_image(data, 1000)
    assert (decoded.width, decoded.height, decoded.format) == (7, 3, fmt)
    assert decoded.sha256 == hashlib.sha256(data).digest()


def noise(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.frombytes("L", (64, 64), bytes((i * 7919) % 251 for i in range(64 * 64))).save(
        out, format=fmt)
    return out.getvalue()


def test_what_is_not_a_whole_supported_image_is_refused() -> None:
    png, jpeg = noise("PNG"), noise("JPEG")
    cases = [(b"hello world", "not_image"), (b"GIF89a but not really", "undecodable"),
             (encoded("BMP"), "not_image"),  # a real image, of a format not taken
             (png[:len(png) // 2], "undecodable"), (jpeg[:len(jpeg) // 2], "undecodable"),
             (png[:40], "undecodable"), (b"RIFF\0\0\0\0WEBPVP8 ", "undecodable")]
    for data, reason in cases:
        with pytest.raises(ImageRefused) as refused:
            decode_image(data, 10**6)
        assert refused.value.reason == reason, data[:20]


def test_the_pixel_cap_refuses_before_decoding() -> None:
    big = encoded("PNG", (100, 50))
    assert decode_image(big, 5000).width == 100
    with pytest.raises(ImageRefused, match=r"100x50, 5000 pixels, more than the 4999") as refused:
        decode_image(big, 4999)
    assert refused.value.reason == "too_many_pixels"
    # A header claiming a huge image (a decompression bomb) is refused unopened.
    bomb = encoded("PNG", (20000, 20000), "1")
    with pytest.raises(ImageRefused, match="more than 89478485 pixels"):
        decode_image(bomb, 89_478_485)
