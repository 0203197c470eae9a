"""Pictures and chat requests the vision tests share."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import numpy as np

from llm_server.api.chat.run import start_chat
from llm_server.api.shared.schemas import ChatRequest
from llm_server.decoding import SamplingParams
from llm_server.images import ImageInput
from llm_server.scheduler import FinishEvent, TokenEvent


def picture(seed: int, size: tuple[int, int] = (50, 40)) -> ImageInput:
    """A random RGB picture (`size`: width, height) as the API layer hands it over."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    image = Image.fromarray(pixels, "RGB")
    digest = hashlib.sha256(f"{image.size}".encode() + image.tobytes()).hexdigest()
    return ImageInput(image, digest, f"messages[0].content[{seed}]")


def ask(image: ImageInput | None, text: str = "What is in the picture?") -> dict[str, Any]:
    """A user turn: the image (if any), then the text, as the API parsers give it."""
    parts: list[dict[str, Any]] = [{"type": "image", "image": image}] if image else []
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def chat(messages: list[dict[str, Any]], max_tokens: int = 10) -> ChatRequest:
    """A greedy chat request of `messages`."""
    return ChatRequest(
        messages=tuple(messages),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        stream=False,
        include_usage=False,
        response_format=None,
        model=None,
    )


async def collect(handle) -> tuple[list[int], FinishEvent]:
    """An admitted request's tokens and finish event (it must not fail)."""
    tokens = [ev.token_id async for ev in handle.events() if isinstance(ev, TokenEvent)]
    assert handle.finish is not None and handle.finish.error is None
    return tokens, handle.finish


def answer(service, request) -> tuple[list[int], FinishEvent]:
    """Greedy tokens and the finish event of one chat request, alone."""

    async def run():
        started = await start_chat(service, request)
        return await collect(started.handles[0])

    return asyncio.run(run())
