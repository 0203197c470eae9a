"""Pictures and chat requests the vision tests share."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from llm_server.api.shared.schemas import ChatRequest
from llm_server.decoding import SamplingParams
from llm_server.images import ImageInput


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
