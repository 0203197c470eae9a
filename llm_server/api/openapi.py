"""The OpenAPI 3.0 description of the routes, served at /openapi.json (hand-written, stable)."""

from __future__ import annotations

from llm_server.api import openapi_agents as agents
from llm_server.api import openapi_tools as tools
from llm_server.api.openapi_embeddings import EMBEDDING_SCHEMAS
from llm_server.api.schemas import MAX_LOGIT_BIAS, MAX_N
from llm_server.decoding import MAX_TOP_LOGPROBS

OPENAPI_VERSION = "3.0.3"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

_STOP = _nullable(
    {"oneOf": [_STR, {"type": "array", "items": {**_STR, "minLength": 1}, "maxItems": 4}]}
)
_SAMPLING = {
    "model": _STR,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": _nullable({"type": "integer", "minimum": 0}),
    "stop": _STOP,
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "top_k": {"type": "integer", "minimum": -1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {
        "type": "number",
        "minimum": 0,
        "maximum": 2,
        "description": "above 0 (0 itself is a 400); 1 is off",
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": _nullable(
        {
            "type": "object",
            "description": "token id (a string of digits) -> bias added to its logit",
            "maxProperties": MAX_LOGIT_BIAS,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
    "stream": _BOOL,
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL}}),
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
        "completion_tokens_details": tools.COMPLETION_DETAILS,
    },
}
_TOP_ENTRY = {
    "type": "object",
    "required": ["token", "logprob"],
    "properties": {
        "token": _STR,
        "logprob": _NUM,
        "bytes": _nullable({"type": "array", "items": _INT}),
    },
}
_CHAT_LOGPROBS = _nullable(
    {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": _nullable(
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
            "refusal": _nullable({"type": "array", "items": _TOP_ENTRY}),
        },
    }
)
_COMPLETION_LOGPROBS = _nullable(
    {
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": _STR},
            "token_logprobs": {"type": "array", "items": _nullable(_NUM)},
            "top_logprobs": {
                "type": "array",
                "items": _nullable({"type": "object", "additionalProperties": _NUM}),
            },
            "text_offset": {"type": "array", "items": _INT},
        },
    }
)
_FINISH = {"type": "string", "enum": ["stop", "length"]}
_ENVELOPE = {"id": _STR, "created": _INT, "model": _STR, "system_fingerprint": _STR}

SCHEMAS: dict[str, dict] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": _STR,
                    "type": _STR,
                    "param": _nullable(_STR),
                    "code": _nullable(_STR),
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
            "content": _nullable(
                {
                    "oneOf": [
                        _STR,
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"type": "string", "enum": ["text"]},
                                    "text": _STR,
                                },
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
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            **_SAMPLING,
            "max_tokens": _nullable({"type": "integer", "minimum": 1}),
            "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
            "logprobs": _nullable(_BOOL),
            "top_logprobs": _nullable(
                {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}
            ),
            "response_format": _nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                        "json_schema": {"type": "object"},
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
                        "index": _INT,
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
                    {**_STR, "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {**_STR, "minLength": 1}},
                    {**_IDS, "minItems": 1},
                    {"type": "array", "minItems": 1, "items": {**_IDS, "minItems": 1}},
                ]
            },
            **_SAMPLING,
            "max_tokens": _nullable({"type": "integer", "minimum": 0}),
            "echo": _nullable(_BOOL),
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
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
                        "index": _INT,
                        "text": _STR,
                        "finish_reason": _FINISH,
                        "logprobs": _COMPLETION_LOGPROBS,
                    },
                },
            },
            "usage": _USAGE,
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object", "created", "owned_by"],
                    "properties": {"id": _STR, "object": _STR, "created": _INT, "owned_by": _STR},
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "ready", "model"],
        "properties": {
            "status": {"type": "string", "enum": ["ok", "loading", "draining"]},
            "ready": _BOOL,
            "model": _STR,
            "blas": _nullable(_STR),
            "engine": _STR,
            "batching": _BOOL,
            "rows_busy": _INT,
            "queue_length": _INT,
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "properties": {
            "model": _STR,
            "prompt": _STR,
            "add_special_tokens": _BOOL,
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        },
    },
    "TokenizeResponse": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens"],
        "properties": {
            "count": _INT,
            "max_model_len": _INT,
            "tokens": {"type": "array", "items": _INT},
            "token_strs": {"type": "array", "items": _STR},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": _STR, "tokens": _IDS},
    },
    "DetokenizeResponse": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": _STR},
    },
    "TokenizerInfo": {
        "type": "object",
        "required": ["eos_token", "bos_token", "pad_token", "chat_template", "name_or_path"],
        "properties": {
            "name_or_path": _STR,
            "tokenizer_class": _STR,
            "eos_token": _nullable(_STR),
            "eos_token_id": _nullable(_INT),
            "bos_token": _nullable(_STR),
            "bos_token_id": _nullable(_INT),
            "pad_token": _nullable(_STR),
            "pad_token_id": _nullable(_INT),
            "unk_token": _nullable(_STR),
            "chat_template": _nullable(_STR),
            "model_max_length": _INT,
            "vocab_size": _INT,
        },
    },
}

_ERROR_STATUSES = {
    "400": "invalid field (the message names it and the allowed range)",
    "401": "missing or wrong API key (/v1/* when a key is set)",
    "404": "unknown model",
    "413": "request body over the size limit",
    "415": "the body is not sent as application/json",
    "429": "every row busy and the queue full (see Retry-After)",
    "503": "the model is loading or the server is shutting down",
}


# One server-sent event: `data` is a JSON chunk (or an error object), then "[DONE]".
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": _STR, "event": _STR, "id": _STR},
}


def _json(schema_name: str, description: str) -> dict:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref(schema_name)}},
    }


def _errors(*statuses: str) -> dict:
    return {s: _json("Error", _ERROR_STATUSES[s]) for s in statuses}


def _post(op_id: str, summary: str, request: str, response: str, stream: bool = False) -> dict:
    ok = _json(response, "success")
    if stream:
        ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": ok, **_errors("400", "401", "404", "413", "415", "429", "503")},
        }
    }


def _get(op_id: str, summary: str, response: dict, *errors: str) -> dict:
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "responses": {"200": response, **_errors(*errors)},
        }
    }


def openapi_schema() -> dict:
    """The whole OpenAPI document."""
    tokenize_post = _post(
        "tokenize", "Token ids for a prompt or messages", "TokenizeRequest", "TokenizeResponse"
    )
    tokenize_post["post"]["responses"] = {
        k: v for k, v in tokenize_post["post"]["responses"].items() if k != "429"
    }
    detok_post = _post(
        "detokenize", "Text for token ids", "DetokenizeRequest", "DetokenizeResponse"
    )
    detok_post["post"]["responses"] = {
        k: v for k, v in detok_post["post"]["responses"].items() if k != "429"
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llm-server",
            "version": "1.0",
            "description": "OpenAI-compatible local LLM server",
        },
        "paths": {
            "/v1/chat/completions": _post(
                "createChatCompletion",
                "Chat completion",
                "ChatCompletionRequest",
                "ChatCompletion",
                stream=True,
            ),
            "/v1/completions": _post(
                "createCompletion",
                "Text completion or scoring",
                "CompletionRequest",
                "Completion",
                stream=True,
            ),
            "/v1/embeddings": _post(
                "createEmbedding",
                "Embeddings of texts or token ids",
                "EmbeddingRequest",
                "EmbeddingList",
            ),
            "/v1/models": _get(
                "listModels", "The served model", _json("ModelList", "the served model"), "401"
            ),
            "/health": _get("health", "Readiness and load", _json("Health", "ready"), "503"),
            "/metrics": _get(
                "metrics",
                "Prometheus metrics",
                {
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": _STR}},
                },
            ),
            "/tokenize": tokenize_post,
            "/detokenize": detok_post,
            "/tokenizer_info": _get(
                "tokenizerInfo",
                "Special tokens and chat template",
                _json("TokenizerInfo", "info"),
                "503",
            ),
            **agents.paths(),
        },
        "components": {
            "schemas": {**SCHEMAS, **agents.SCHEMAS, **EMBEDDING_SCHEMAS},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
