"""Images a request carries: each API's image part is kept as an `ImageRef` while the body is
parsed, then decoded here by the server (Pillow, within `ImageLimits`) into the `ImageInput`s of
llm_server/images.py before the request is planned. A request string never reaches a model's
processor; bad images are 400s naming the field, refused before any row is taken."""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from PIL import Image, ImageOps
from starlette.requests import Request

from llm_server.api.shared.errors import invalid
from llm_server.api.shared.image_cache import Decoded, DecodedImages
from llm_server.images import ImageInput
from llm_server.service import ModelService
from llm_server.settings import ImageLimits

# Pillow format -> the media type it is sent as; only these are decoded
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
MEDIA_TYPES = {**{v: k for k, v in FORMATS.items()}, "image/jpg": "JPEG"}
DETAILS = ("auto", "low", "high")
KINDS = "PNG, JPEG, WebP or GIF"
INLINE = "send the image inline as a data: URL (data:image/png;base64,...)"
MAX_REDIRECTS = 3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Past our own --max-image-pixels check an image is refused anyway: Pillow's warning is noise
warnings.simplefilter("ignore", Image.DecompressionBombWarning)

Chat = TypeVar("Chat")
DECODED = DecodedImages()  # the process's decoded files (every app and model shares them)


@dataclass(frozen=True)
class ImageRef:
    """An image part as the request gave it: checked for shape, not yet read or decoded."""

    field: str  # the request field ("messages[1].content[0].image_url")
    url: str | None = None  # a data: or http(s) URL as sent
    data: str | None = None  # base64 without a URL (Anthropic's base64 source)
    media_type: str | None = None  # the media type the request declared with `data`


def image_part(ref: ImageRef) -> dict[str, Any]:
    """The message part an image travels in (llm_server/images.py)."""
    return {"type": "image", "image": ref}


def is_image_part(part: Any) -> bool:
    """A part an adapter built (never one a client can send: its `image` is an object)."""
    return (
        isinstance(part, dict)
        and part.get("type") == "image"
        and isinstance(part.get("image"), ImageRef | ImageInput)
    )


def url_ref(url: Any, field: str) -> ImageRef:
    """An image given by URL (Chat `image_url`, Responses `image_url`, Anthropic `url`)."""
    if not isinstance(url, str) or not url.strip():
        raise invalid(field, f"'{field}' must be a non-empty URL string; {INLINE}")
    return ImageRef(field, url=url.strip())


def check_detail(detail: Any, field: str) -> None:
    """OpenAI's `detail`: accepted and checked; the model's own processor sizes the image."""
    if detail is not None and detail not in DETAILS:
        raise invalid(field, f"'{field}' must be one of {', '.join(DETAILS)}, not {detail!r}")


def base64_ref(source: Any, field: str) -> ImageRef:
    """Anthropic's `source`: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        return url_ref(source.get("url"), f"{field}.url")
    if kind != "base64":
        why = "file sources need Anthropic's Files API; " if kind == "file" else ""
        raise invalid(
            field,
            f"an image block needs a 'source' of type 'base64' (media_type and data) or 'url'; "
            f"{why}got {kind!r}",
        )
    media, data = source.get("media_type"), source.get("data")
    if media not in MEDIA_TYPES:
        raise invalid(
            f"{field}.media_type",
            f"'media_type' must be image/png, image/jpeg, image/webp or image/gif, not {media!r}",
        )
    if not isinstance(data, str) or not data:
        raise invalid(f"{field}.data", "'data' must be the image file as a base64 string")
    return ImageRef(field, data=data, media_type=media)


def _data_field(ref: ImageRef) -> str:
    return f"{ref.field}.data" if ref.data is not None else ref.field


def _unbase64(text: str, field: str, limits: ImageLimits) -> bytes:
    packed = "".join(text.split())
    if len(packed) // 4 * 3 > limits.max_bytes:
        raise _too_many_bytes(field, len(packed) // 4 * 3, limits)
    try:
        return base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(
            field, "the image is not valid base64 (standard alphabet, '=' padding)"
        ) from None


def _too_many_bytes(field: str, size: int, limits: ImageLimits) -> Exception:
    return invalid(
        field,
        f"the image file is {size:,} bytes, more than this server takes ({limits.max_bytes:,}, "
        "--max-image-bytes); send a smaller file",
    )


def _data_url(url: str, field: str, limits: ImageLimits) -> tuple[bytes, str | None]:
    """`data:image/png;base64,...` -> (file bytes, declared media type or None)."""
    head, comma, payload = url[len("data:") :].partition(",")
    params = [p.strip().lower() for p in head.split(";")]
    if not comma or "base64" not in params[1:]:
        raise invalid(field, f"a data: URL must be base64, as data:image/png;base64,...; {INLINE}")
    media = params[0] or None
    if media is not None and media not in MEDIA_TYPES:
        raise invalid(field, f"unsupported image type {media!r}: send {KINDS}")
    return _unbase64(payload, field, limits), media


async def _fetch(url: str, field: str, limits: ImageLimits) -> bytes:
    """The body of an http(s) URL: at most --max-image-bytes, within the timeout (400s)."""
    why = None
    try:
        async with (
            asyncio.timeout(limits.url_timeout),
            httpx.AsyncClient(
                timeout=limits.url_timeout, follow_redirects=True, max_redirects=MAX_REDIRECTS
            ) as client,
            client.stream("GET", url) as resp,
        ):
            if resp.status_code != 200:
                raise invalid(field, f"fetching the image answered HTTP {resp.status_code}")
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limits.max_bytes:
                raise _too_many_bytes(field, int(declared), limits)
            body = bytearray()
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > limits.max_bytes:
                    raise _too_many_bytes(field, len(body), limits)
            return bytes(body)
    except (TimeoutError, httpx.TimeoutException):
        why = f"took longer than {limits.url_timeout:g} s"
    except httpx.HTTPError as exc:
        why = f"failed ({type(exc).__name__})"
    raise invalid(field, f"fetching the image URL {why}; {INLINE}")


async def _file_bytes(ref: ImageRef, limits: ImageLimits) -> tuple[bytes, str | None]:
    """The image file `ref` names and its declared media type (None: tell by the bytes)."""
    if ref.data is not None:
        return _unbase64(ref.data, _data_field(ref), limits), ref.media_type
    url = ref.url or ""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, ref.field, limits)
    if scheme in ("http", "https"):
        if not limits.allow_urls:
            raise invalid(
                ref.field,
                f"this server does not fetch image URLs; {INLINE}, or the operator must start "
                "the server with --allow-image-urls",
            )
        return await _fetch(url, ref.field, limits), None
    if scheme == "file":
        raise invalid(ref.field, f"file:// URLs are never read; {INLINE}")
    raise invalid(ref.field, f"unsupported image URL scheme {scheme or url[:16]!r}; {INLINE}")


def decode_image(
    data: bytes,
    field: str,
    limits: ImageLimits,
    media_type: str | None = None,
    media_field: str | None = None,
) -> ImageInput:
    """A PNG/JPEG/WebP/GIF (first frame) file as an RGB `ImageInput` (400s name `field`).

    The size is read from the header and checked before any pixel is decoded, so a
    decompression bomb is refused without being expanded; the digest covers mode, size and
    pixels, so the same picture in another file format has the same digest. A file decoded
    before (DECODED) is not decoded again; the limits are checked again."""
    if not data:
        raise invalid(field, "the image is empty (0 bytes); send a PNG, JPEG, WebP or GIF file")
    if len(data) > limits.max_bytes:
        raise _too_many_bytes(field, len(data), limits)
    key = hashlib.sha256(data).digest()
    decoded = DECODED.get(key) or _decode(data, field, limits)
    if media_type is not None and MEDIA_TYPES[media_type] != decoded.format:
        raise invalid(
            media_field or field,
            f"the image is {FORMATS[decoded.format]} but the media type says {media_type}; "
            "send the type that matches the data",
        )
    width, height = decoded.image.size
    if width * height > limits.max_pixels:  # decoded before under a larger limit
        raise _too_many_pixels(field, width * height, limits, f"{width}x{height} = ")
    DECODED.put(key, decoded)
    return ImageInput(image=decoded.image, digest=decoded.digest, field=field)


def _decode(data: bytes, field: str, limits: ImageLimits) -> Decoded:
    # Pillow's own check (an error past twice the limit) is a second guard behind ours
    Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, limits.max_pixels)
    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError as exc:  # "Image size (N pixels) exceeds limit ..."
        pixels = re.search(r"\d+", str(exc))
        raise _too_many_pixels(field, int(pixels[0]) if pixels else None, limits) from None
    except Exception:  # any failure to parse untrusted bytes is a bad image
        if _zero_sized(data):  # Pillow opens no image without pixels
            raise invalid(field, "the image is 0 pixels wide or high: it has no pixels") from None
        raise invalid(
            field, f"the data is not a {KINDS} image, or it is corrupt or truncated"
        ) from None
    width, height = img.size
    if width == 0 or height == 0:
        raise invalid(field, f"the image is {width}x{height} pixels: it has no pixels")
    if width * height > limits.max_pixels:
        raise _too_many_pixels(field, width * height, limits, f"{width}x{height} = ")
    try:
        img.load()  # the first frame of an animation
        rgb = _rgb(ImageOps.exif_transpose(img))
    except Exception as exc:  # Pillow's decoders raise many kinds on bad data
        raise invalid(
            field, f"the image data is corrupt or truncated ({exc}); send the whole file"
        ) from None
    digest = hashlib.sha256(f"{rgb.mode} {rgb.width}x{rgb.height}\n".encode())
    digest.update(rgb.tobytes())
    return Decoded(rgb, digest.hexdigest(), img.format or "")


def _too_many_pixels(
    field: str, pixels: int | None, limits: ImageLimits, dims: str = ""
) -> Exception:
    what = f"{dims}{pixels:,} pixels" if pixels else "far larger"
    return invalid(
        field,
        f"the image is {what}, more than this server takes ({limits.max_pixels:,} pixels, "
        "--max-image-pixels); scale it down",
    )


def _zero_sized(data: bytes) -> bool:
    """A PNG or GIF header that gives a width or height of 0."""
    if data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR" and len(data) >= 24:
        return 0 in (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"))
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return 0 in (int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little"))
    return False


def _rgb(img: Image.Image) -> Image.Image:
    """RGB, transparent pixels on white (as a viewer shows them)."""
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


async def load_image(ref: ImageRef, limits: ImageLimits) -> ImageInput:
    """`ref` read (a fetch only with --allow-image-urls) and decoded off the event loop."""
    data, media = await _file_bytes(ref, limits)
    media_field = f"{ref.field}.media_type" if ref.data is not None else ref.field
    image = await asyncio.to_thread(
        decode_image, data, _data_field(ref), limits, media, media_field
    )
    return dataclasses.replace(image, field=ref.field)  # the part's field, not its `data`


def _refs(messages: tuple[dict[str, Any], ...]) -> list[ImageRef | ImageInput]:
    return [
        p["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if is_image_part(p)
    ]


async def load_images(
    messages: tuple[dict[str, Any], ...],
    limits: ImageLimits,
    model: str,
    takes_images: bool,
    why: str | None = None,
) -> tuple[dict[str, Any], ...]:
    """`messages` with every ImageRef decoded into an ImageInput (the same tuple when none).

    400s: more images than --max-images, each bad image (the first in prompt order), then an
    image a client sent to a model that reads text only (`takes_images` False), naming
    `model`. An image inside a tool's result (an agent's Read of a PNG, a screenshot tool) is
    the agent's, not the user's choice: for a text model it becomes a line saying it was
    omitted, so the conversation goes on (refused, every later turn would be refused too)."""
    images = _refs(messages)
    if not images:
        return messages
    if len(images) > limits.max_images:
        raise invalid(
            images[limits.max_images].field,
            f"the request carries {len(images)} images; this server takes at most "
            f"{limits.max_images} per request (--max-images)",
        )
    loaded = {id(r): await load_image(r, limits) for r in images if isinstance(r, ImageRef)}
    if not takes_images:
        messages = tuple(_tool_images_omitted(m) for m in messages)
        images = _refs(messages)
        if not images:
            return messages
        raise invalid(
            images[0].field,
            f"model {model!r} reads text only and cannot take the image at {images[0].field}"
            + (f" ({why})" if why else "")
            + "; remove the image, or send it to a vision-language model",
        )
    return tuple(
        {**m, "content": [_loaded(p, loaded) for p in m["content"]]}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    )


def _tool_images_omitted(message: dict[str, Any]) -> dict[str, Any]:
    """A tool result's image parts as a line of text each (the content one string again)."""
    content = message.get("content")
    if message.get("role") != "tool" or not isinstance(content, list):
        return message
    if not any(is_image_part(p) for p in content):
        return message
    note = "[image omitted: this model reads text only]\n"
    text = "".join(note if is_image_part(p) else p.get("text", "") for p in content)
    return {**message, "content": text}


def _loaded(part: Any, loaded: dict[int, ImageInput]) -> Any:
    if is_image_part(part) and id(part["image"]) in loaded:
        return {"type": "image", "image": loaded[id(part["image"])]}
    return part


async def with_images(request: Request, service: ModelService, chat: Chat, model: str) -> Chat:
    """`chat` (a ChatRequest) with its images decoded under the app's limits (400s)."""
    messages = chat.messages  # type: ignore[attr-defined]
    if not _refs(messages):
        return chat
    limits: ImageLimits = request.app.state.image_limits
    done = await load_images(
        messages, limits, model, service.vision is not None, service.vision_error
    )
    return dataclasses.replace(chat, messages=done)  # type: ignore[type-var]


def input_modalities(service: ModelService | None) -> list[str] | None:
    """What /v1/models says a model reads: ["text"] or ["text", "image"] (None: not loaded,
    so not known yet)."""
    if service is None:
        return None
    return ["text", "image"] if service.vision is not None else ["text"]
