"""OpenAPI pieces for the image parts of the three chat APIs (api/shared/images.py)."""

from __future__ import annotations

from llm_server.api.openapi.blocks import STR
from llm_server.api.shared.images import DETAILS, MEDIA_TYPES

_URL = (
    "a data: URL (data:image/png;base64,...; PNG, JPEG, WebP or GIF, the first frame), or an "
    "http(s) URL when the server runs with --allow-image-urls; file:// never; "
    "a text-only model answers 400 (see /v1/models input_modalities)"
)
_DETAIL = {"type": "string", "enum": list(DETAILS), "description": "accepted and checked"}

CHAT_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "description": "an image in a user (or tool) message",
    "properties": {
        "type": {"type": "string", "enum": ["image_url"]},
        "image_url": {
            "oneOf": [
                {**STR, "description": _URL},
                {
                    "type": "object",
                    "required": ["url"],
                    "properties": {"url": {**STR, "description": _URL}, "detail": _DETAIL},
                },
            ]
        },
    },
}
RESPONSES_IMAGE_PART = {
    "type": "object",
    "required": ["type"],
    "description": "an image in a user message or a function_call_output's output; "
    "`file_id` is refused (400): send `image_url`",
    "properties": {
        "type": {"type": "string", "enum": ["input_image"]},
        "image_url": {**STR, "description": _URL},
        "detail": _DETAIL,
        "file_id": STR,
    },
}
ANTHROPIC_IMAGE_SOURCE = {
    "oneOf": [
        {
            "type": "object",
            "required": ["type", "media_type", "data"],
            "properties": {
                "type": {"type": "string", "enum": ["base64"]},
                "media_type": {
                    "type": "string",
                    "enum": sorted(m for m in MEDIA_TYPES if m != "image/jpg"),
                },
                "data": {**STR, "description": "the image file, base64"},
            },
        },
        {
            "type": "object",
            "required": ["type", "url"],
            "description": "only when the server runs with --allow-image-urls",
            "properties": {"type": {"type": "string", "enum": ["url"]}, "url": STR},
        },
    ],
    "description": "an `image` block's source, in a user message or a tool_result's content; "
    "a text-only model answers 400",
}
INPUT_MODALITIES = {
    "type": "array",
    "items": {"type": "string", "enum": ["text", "image"]},
    "nullable": True,
    "description": "what the model reads: [text], or [text, image] for a vision-language "
    "model (null: a model of --models not loaded yet)",
}
