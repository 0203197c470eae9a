"""The OpenAPI schemas and paths of the read-only routes (api/info.py): models, health,
metrics and the tokenizer endpoints."""

from __future__ import annotations

from llm_server.api.openapi.blocks import (
    BOOL,
    INT,
    POST_ERRORS,
    STR,
    TOKEN_IDS,
    get_path,
    json_response,
    list_of,
    nullable,
    post_path,
    ref,
)
from llm_server.api.openapi.images import INPUT_MODALITIES

_NO_QUEUE = tuple(s for s in POST_ERRORS if s != "429")  # tokenizing never waits for a row

SCHEMAS = {
    "ModelList": list_of(
        {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": STR,
                "object": STR,
                "created": INT,
                "owned_by": STR,
                "input_modalities": INPUT_MODALITIES,
            },
        }
    ),
    "Health": {
        "type": "object",
        "required": ["status", "ready", "model"],
        "properties": {
            "status": {"type": "string", "enum": ["ok", "loading", "draining"]},
            "ready": BOOL,
            "model": STR,
            "blas": nullable(STR),
            "engine": STR,
            "batching": BOOL,
            "rows_busy": INT,
            "queue_length": INT,
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "properties": {
            "model": STR,
            "prompt": STR,
            "add_special_tokens": BOOL,
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
        },
    },
    "TokenizeResponse": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": INT,
            "max_model_len": INT,
            "tokens": {"type": "array", "items": INT},
            "token_strs": {"type": "array", "items": STR},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": STR, "tokens": TOKEN_IDS},
    },
    "DetokenizeResponse": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": STR},
    },
    "TokenizerInfo": {
        "type": "object",
        "required": ["eos_token", "bos_token", "pad_token", "chat_template", "name_or_path"],
        "properties": {
            "name_or_path": STR,
            "tokenizer_class": STR,
            "eos_token": nullable(STR),
            "eos_token_id": nullable(INT),
            "bos_token": nullable(STR),
            "bos_token_id": nullable(INT),
            "pad_token": nullable(STR),
            "pad_token_id": nullable(INT),
            "unk_token": nullable(STR),
            "chat_template": nullable(STR),
            "model_max_length": INT,
            "vocab_size": INT,
        },
    },
}


def paths() -> dict[str, dict]:
    """The path items of the read-only routes."""
    return {
        "/v1/models": get_path(
            "listModels",
            "The served model",
            json_response("ModelList", "the served model"),
            "401",
        ),
        "/health": get_path(
            "health", "Readiness and load", json_response("Health", "ready"), "503"
        ),
        "/metrics": get_path(
            "metrics",
            "Prometheus metrics",
            {
                "description": "Prometheus text format",
                "content": {"text/plain": {"schema": STR}},
            },
        ),
        "/tokenize": post_path(
            "tokenize",
            "Token ids for a prompt or messages",
            "TokenizeRequest",
            "TokenizeResponse",
            statuses=_NO_QUEUE,
        ),
        "/detokenize": post_path(
            "detokenize",
            "Text for token ids",
            "DetokenizeRequest",
            "DetokenizeResponse",
            statuses=_NO_QUEUE,
        ),
        "/tokenizer_info": get_path(
            "tokenizerInfo",
            "Special tokens and chat template",
            json_response("TokenizerInfo", "info"),
            "503",
        ),
    }
