"""The OpenAPI 3.0 description of the routes, served at /openapi.json (hand-written, stable)."""

from __future__ import annotations

from llm_server.api import openapi_agents as agents
from llm_server.api import openapi_tools as tools
from llm_server.api.openapi_common import (
    BOOL,
    INT,
    NUM,
    STR,
    json_response,
    list_of,
    nullable,
    post,
    ref,
)
from llm_server.api.openapi_embeddings import EMBEDDING_SCHEMAS
from llm_server.api.schemas import MAX_LOGIT_BIAS, MAX_N
from llm_server.decoding import MAX_TOP_LOGPROBS

OPENAPI_VERSION = "3.0.3"


_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

_STOP = nullable(
    {"oneOf": [STR, {"type": "array", "items": {**STR, "minLength": 1}, "maxItems": 4}]}
)
_SAMPLING = {
    "model": STR,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": nullable({"type": "integer", "minimum": 0}),
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
    "logit_bias": nullable(
        {
            "type": "object",
            "description": "token id (a string of digits) -> bias added to its logit",
            "maxProperties": MAX_LOGIT_BIAS,
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
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
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {
                                    "type": {"type": "string", "enum": ["text"]},
                                    "text": STR,
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
                    {**_IDS, "minItems": 1},
                    {"type": "array", "minItems": 1, "items": {**_IDS, "minItems": 1}},
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
    "ModelList": list_of(
        {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": STR, "object": STR, "created": INT, "owned_by": STR},
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
        "properties": {"model": STR, "tokens": _IDS},
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
    "properties": {"data": STR, "event": STR, "id": STR},
}


_POST_ERRORS = ("400", "401", "404", "413", "415", "429", "503")


def _errors(*statuses: str) -> dict:
    return {s: json_response("Error", _ERROR_STATUSES[s]) for s in statuses}


def _post(
    op_id: str,
    summary: str,
    request: str,
    response: str,
    stream: bool = False,
    errors: tuple[str, ...] = _POST_ERRORS,
) -> dict:
    ok = json_response(response, "success")
    if stream:
        ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    return post(op_id, summary, request, ok, _errors(*errors))


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
    no_queue = tuple(s for s in _POST_ERRORS if s != "429")  # tokenizing never waits for a row
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
                "listModels",
                "The served model",
                json_response("ModelList", "the served model"),
                "401",
            ),
            "/health": _get(
                "health", "Readiness and load", json_response("Health", "ready"), "503"
            ),
            "/metrics": _get(
                "metrics",
                "Prometheus metrics",
                {
                    "description": "Prometheus text format",
                    "content": {"text/plain": {"schema": STR}},
                },
            ),
            "/tokenize": _post(
                "tokenize",
                "Token ids for a prompt or messages",
                "TokenizeRequest",
                "TokenizeResponse",
                errors=no_queue,
            ),
            "/detokenize": _post(
                "detokenize",
                "Text for token ids",
                "DetokenizeRequest",
                "DetokenizeResponse",
                errors=no_queue,
            ),
            "/tokenizer_info": _get(
                "tokenizerInfo",
                "Special tokens and chat template",
                json_response("TokenizerInfo", "info"),
                "503",
            ),
            **agents.paths(),
        },
        "components": {
            "schemas": {**SCHEMAS, **agents.SCHEMAS, **EMBEDDING_SCHEMAS},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
