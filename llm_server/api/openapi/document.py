"""The OpenAPI 3.0 description of the routes, served at /openapi.json (hand-written, stable)."""

from __future__ import annotations

from llm_server.api.openapi import agents, batches, images, info, tools
from llm_server.api.openapi.blocks import (
    BOOL,
    INT,
    NUM,
    STR,
    TOKEN_IDS,
    nullable,
    number_range,
    post_path,
    ref,
)
from llm_server.api.openapi.embeddings import EMBEDDING_SCHEMAS
from llm_server.api.shared.sampling_fields import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCES,
    PENALTY_RANGE,
    PROBABILITY_RANGE,
    TEMPERATURE_RANGE,
)
from llm_server.decoding import MAX_TOP_LOGPROBS

OPENAPI_VERSION = "3.0.3"


_STOP = nullable(
    {
        "oneOf": [
            STR,
            {"type": "array", "items": {**STR, "minLength": 1}, "maxItems": MAX_STOP_SEQUENCES},
        ]
    }
)
_SAMPLING = {
    "model": STR,
    "temperature": number_range(*TEMPERATURE_RANGE),
    "top_p": number_range(*PROBABILITY_RANGE),
    "seed": nullable({"type": "integer", "minimum": 0}),
    "stop": _STOP,
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": number_range(*PROBABILITY_RANGE),
    "repetition_penalty": {
        **number_range(0, MAX_REPETITION_PENALTY),
        "description": "above 0 (0 itself is a 400); 1 is off",
    },
    "presence_penalty": number_range(-PENALTY_RANGE, PENALTY_RANGE),
    "frequency_penalty": number_range(-PENALTY_RANGE, PENALTY_RANGE),
    "logit_bias": nullable(
        {
            "type": "object",
            "description": "token id (a string of digits) -> bias added to its logit",
            "maxProperties": MAX_LOGIT_BIAS,
            "additionalProperties": number_range(-LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE),
        }
    ),
    "stream": BOOL,
    "stream_options": nullable({"type": "object", "properties": {"include_usage": BOOL}}),
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": INT,
        "completion_tokens": INT,
        "total_tokens": INT,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": INT}},
        "completion_tokens_details": tools.COMPLETION_DETAILS,
    },
}
_TOP_ENTRY = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        "token": STR,
        "logprob": NUM,
        "bytes": nullable({"type": "array", "items": INT}),
    },
}
_CHAT_LOGPROBS = nullable(
    {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": nullable(
                {
                    "type": "array",
                    "items": {
                        **_TOP_ENTRY,
                        "properties": {
                            **_TOP_ENTRY["properties"],
                            "top_logprobs": {"type": "array", "items": _TOP_ENTRY},
                        },
                    },
                }
            ),
            "refusal": nullable({"type": "array", "items": _TOP_ENTRY}),
        },
    }
)
_COMPLETION_LOGPROBS = nullable(
    {
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": STR},
            "token_logprobs": {"type": "array", "items": nullable(NUM)},
            "top_logprobs": {
                "type": "array",
                "items": nullable({"type": "object", "additionalProperties": NUM}),
            },
            "text_offset": {"type": "array", "items": INT},
        },
    }
)
_FINISH = {"type": "string", "enum": ["stop", "length"]}
_ENVELOPE = {"id": STR, "created": INT, "model": STR, "system_fingerprint": STR}

SCHEMAS: dict[str, dict] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": STR,
                    "type": STR,
                    "param": nullable(STR),
                    "code": nullable(STR),
                },
            }
        },
    },
    "ChatMessage": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {
                "type": "string",
                "enum": ["system", "user", "assistant", "developer", "tool"],
            },
            "content": nullable(
                {
                    "oneOf": [
                        STR,
                        {
                            "type": "array",
                            "items": {
                                "oneOf": [
                                    {
                                        "type": "object",
                                        "required": ["type", "text"],
                                        "properties": {
                                            "type": {"type": "string", "enum": ["text"]},
                                            "text": STR,
                                        },
                                    },
                                    images.CHAT_IMAGE_PART,
                                ]
                            },
                        },
                    ]
                }
            ),
            **tools.MESSAGE_FIELDS,
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": ref("ChatMessage")},
            **_SAMPLING,
            "max_tokens": nullable({"type": "integer", "minimum": 1}),
            "max_completion_tokens": nullable({"type": "integer", "minimum": 1}),
            "logprobs": nullable(BOOL),
            "top_logprobs": nullable(
                {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
            ),
            "response_format": nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                        "json_schema": {"type": "object"},
                    },
                }
            ),
            "prediction": nullable(
                {
                    "type": "object",
                    "required": ["type", "content"],
                    "properties": {
                        "type": {"type": "string", "enum": ["content"]},
                        "content": {"oneOf": [STR, {"type": "array", "items": {"type": "object"}}]},
                    },
                }
            ),
            **tools.REQUEST_FIELDS,
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **_ENVELOPE,
            "object": {"type": "string", "enum": ["chat.completion"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "message", "finish_reason"],
                    "properties": {
                        "index": INT,
                        "message": tools.RESPONSE_MESSAGE,
                        "finish_reason": tools.CHAT_FINISH,
                        "logprobs": _CHAT_LOGPROBS,
                    },
                },
            },
            "usage": _USAGE,
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "oneOf": [
                    {**STR, "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {**STR, "minLength": 1}},
                    {**TOKEN_IDS, "minItems": 1},
                    {"type": "array", "minItems": 1, "items": {**TOKEN_IDS, "minItems": 1}},
                ]
            },
            **_SAMPLING,
            "max_tokens": nullable({"type": "integer", "minimum": 0}),
            "echo": nullable(BOOL),
            "logprobs": nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **_ENVELOPE,
            "object": {"type": "string", "enum": ["text_completion"]},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", "text", "finish_reason"],
                    "properties": {
                        "index": INT,
                        "text": STR,
                        "finish_reason": _FINISH,
                        "logprobs": _COMPLETION_LOGPROBS,
                    },
                },
            },
            "usage": _USAGE,
        },
    },
}


def openapi_schema() -> dict:
    """The whole OpenAPI document."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llm-server",
            "version": "1.0",
            "description": "OpenAI-compatible local LLM server",
        },
        "paths": {
            "/v1/chat/completions": post_path(
                "createChatCompletion",
                "Chat completion",
                "ChatCompletionRequest",
                "ChatCompletion",
                stream=True,
            ),
            "/v1/completions": post_path(
                "createCompletion",
                "Text completion or scoring",
                "CompletionRequest",
                "Completion",
                stream=True,
            ),
            "/v1/embeddings": post_path(
                "createEmbedding",
                "Embeddings of texts or token ids",
                "EmbeddingRequest",
                "EmbeddingList",
            ),
            **info.paths(),
            **agents.paths(),
            **batches.paths(),
        },
        "components": {
            "schemas": {
                **SCHEMAS,
                **info.SCHEMAS,
                **agents.SCHEMAS,
                **EMBEDDING_SCHEMAS,
                **batches.SCHEMAS,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
