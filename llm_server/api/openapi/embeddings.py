"""The OpenAPI schemas of POST /v1/embeddings (merged into api/openapi/document.py's document)."""

from __future__ import annotations

from llm_server.api.openai.embeddings import ENCODINGS, INPUT_TYPES, MAX_INPUTS
from llm_server.api.openapi.blocks import INT, STR, list_of

_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}

EMBEDDING_SCHEMAS: dict[str, dict] = {
    "EmbeddingRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "input": {
                "oneOf": [
                    {**STR, "minLength": 1},
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_INPUTS,
                        "items": {**STR, "minLength": 1},
                    },
                    _IDS,
                    {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS, "items": _IDS},
                ]
            },
            "model": STR,
            "encoding_format": {"type": "string", "enum": list(ENCODINGS)},
            "dimensions": {"type": "integer", "minimum": 1},
            "input_type": {"type": "string", "enum": list(INPUT_TYPES)},
            "user": STR,
        },
    },
    "EmbeddingList": list_of(
        {
            "type": "object",
            "required": ["object", "index", "embedding"],
            "properties": {
                "object": {"type": "string", "enum": ["embedding"]},
                "index": INT,
                "embedding": {
                    "oneOf": [
                        {"type": "array", "items": {"type": "number"}},
                        {**STR, "description": "base64 of little-endian float32"},
                    ]
                },
            },
        },
        model=STR,
        usage={
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {"prompt_tokens": INT, "total_tokens": INT},
        },
    ),
}
