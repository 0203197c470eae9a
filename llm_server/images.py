"""An image a request carries, decoded by the server (never by a model's processor).

The API layer (`api/`) turns each API's image parts (Chat Completions `image_url`, Responses
`input_image`, Messages `image` blocks) into `ImageInput`s after decoding and checking them;
a chat message that carries images keeps its content as a list of parts in the user's order:

    {"type": "text", "text": str}
    {"type": "image", "image": ImageInput}

Messages without images keep plain string content. A vision-language model's renderer
(`ModelService.vision`) turns such messages into prompt ids with placeholder positions and the
`EmbeddingSpan`s of each image (`engines/plan.py`); a text-only model refuses them with a 400
naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True, eq=False)
class ImageInput:
    # RGB, within the server's limits; shared by every request that sends the same file: read only
    image: Image.Image
    digest: str  # SHA-256 hex of the decoded pixels and size: the prefix cache's key
    field: str  # the request field it came from ("messages[1].content[0].image_url")


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message carries an image part."""
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
        for m in messages
    )


def images_of(messages: list[dict[str, Any]]) -> list[ImageInput]:
    """Every image part's `ImageInput`, in prompt order."""
    return [
        p["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    ]
