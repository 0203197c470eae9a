"""Small image files the image tests send (good ones, broken ones, a decompression bomb) and the
bodies and error checks those tests share."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

import httpx
from PIL import Image


def png(size: tuple[int, int] = (4, 4), color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    return _saved(Image.new("RGB", size, color), "PNG")


def noise_png(side: int = 64) -> bytes:
    """A PNG that compresses badly, so a cut one is missing pixel data, not its header."""
    rng = random.Random(49)
    img = Image.frombytes(
        "RGB", (side, side), bytes(rng.randrange(256) for _ in range(side * side * 3))
    )
    return _saved(img, "PNG")


def gif() -> bytes:
    """Two frames: red, then blue."""
    red, blue = Image.new("RGB", (3, 3), (255, 0, 0)), Image.new("RGB", (3, 3), (0, 0, 255))
    out = io.BytesIO()
    red.save(out, "GIF", save_all=True, append_images=[blue], duration=100)
    return out.getvalue()


def bmp() -> bytes:
    return _saved(Image.new("RGB", (4, 4)), "BMP")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with_header(width: int, height: int) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )


def bomb_png(width: int, height: int) -> bytes:
    """A few bytes whose header claims `width` x `height` pixels."""
    return _png_with_header(width, height)


def zero_png() -> bytes:
    return _png_with_header(0, 5)


def _saved(img: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def chat_body(url: str) -> dict:
    """A chat completion body: a question, then the image at `url` (messages[0].content[1])."""
    parts = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}


def assert_anthropic_error(resp: httpx.Response, status: int, *words: str) -> str:
    """`resp` has `status` and Anthropic's error body whose message holds `words`."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == "invalid_request_error"
    message = body["error"]["message"]
    for w in words:
        assert w in message, (w, message)
    return message
