"""OpenAPI pieces for /v1/responses and /v1/messages (merged into the document by document.py)."""

from __future__ import annotations

from llm_server.api.anthropic import fields as messages_fields
from llm_server.api.anthropic import input as messages_input
from llm_server.api.openai.responses import input as responses_input
from llm_server.api.openapi import images
from llm_server.api.openapi.blocks import (
    BOOL,
    INT,
    OBJ,
    STR,
    json_response,
    nullable,
    number_range,
    post,
)
from llm_server.api.shared.sampling_fields import PROBABILITY_RANGE, TEMPERATURE_RANGE

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text"]},
        "text": STR,
    },
}
_INPUT_PART = {"oneOf": [_TEXT_PART, images.RESPONSES_IMAGE_PART]}
_CALL_FIELDS = {"call_id": STR, "name": STR, "namespace": STR, "arguments": STR, "input": STR}
_INPUT_ITEM = {
    "type": "object",
    "description": "a message (role + content), a function_call or custom_tool_call (as this "
    "server returned it, `incomplete` ones included), its output, or a reasoning item",
    "properties": {
        "type": {
            "type": "string",
            "enum": [
                "message",
                "function_call",
                "function_call_output",
                "custom_tool_call",
                "custom_tool_call_output",
                "reasoning",
            ],
        },
        "id": STR,
        "status": STR,
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [STR, {"type": "array", "items": _INPUT_PART}]},
        **_CALL_FIELDS,
        "output": {"oneOf": [STR, {"type": "array", "items": _INPUT_PART}]},
    },
}
_OUTPUT_ITEM = {
    "type": "object",
    "required": ["id", "type"],
    "properties": {
        "id": STR,
        "type": {
            "type": "string",
            "enum": ["message", "function_call", "custom_tool_call", "reasoning"],
        },
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
        "role": STR,
        "content": {"type": "array", "items": OBJ},
        "summary": {"type": "array", "items": OBJ},
        **_CALL_FIELDS,
    },
}
_RESPONSES_TOOL = {
    "type": "object",
    "required": ["type"],
    "description": "function, custom (free-form text input) or namespace (a group of function "
    "and custom tools); hosted tools (web_search, file_search, code_interpreter, ...) are "
    "accepted and left out of the prompt (header x-llm-server-dropped-tools)",
    "properties": {"type": STR, "name": STR, "description": STR, "parameters": OBJ},
}
_ANT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {
            "type": "string",
            "enum": ["text", "image", "tool_use", "tool_result", "thinking"],
        },
        "source": images.ANTHROPIC_IMAGE_SOURCE,
        "text": STR,
        "id": STR,
        "name": STR,
        "input": OBJ,
        "tool_use_id": STR,
        "content": {
            "oneOf": [STR, {"type": "array", "items": OBJ}],
            "description": "a tool_result's text and image blocks",
        },
        "thinking": STR,
    },
}
_ANT_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["user", "assistant", "system"]},
            "content": {"oneOf": [STR, {"type": "array", "items": _ANT_BLOCK}]},
        },
    },
}
_ANT_TOOLS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "input_schema"],
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
            "description": STR,
            "input_schema": OBJ,
        },
    },
}
_ANT_PROMPT = {
    "model": STR,
    "system": {"oneOf": [STR, {"type": "array", "items": OBJ}]},
    "messages": _ANT_MESSAGES,
    "tools": _ANT_TOOLS,
    "tool_choice": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
            "name": STR,
            "disable_parallel_tool_use": BOOL,
        },
    },
    "thinking": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]},
            "budget_tokens": {"type": "integer", "minimum": 1024},
        },
    },
}

SCHEMAS: dict[str, dict] = {
    "ResponsesRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": STR,
            "input": {"oneOf": [{**STR, "minLength": 1}, {"type": "array", "items": _INPUT_ITEM}]},
            "instructions": nullable(STR),
            "previous_response_id": nullable(STR),
            "store": nullable(BOOL),
            "stream": nullable(BOOL),
            "max_output_tokens": nullable({"type": "integer", "minimum": 1}),
            "temperature": nullable(number_range(*TEMPERATURE_RANGE)),
            "top_p": nullable(number_range(*PROBABILITY_RANGE)),
            "tools": nullable({"type": "array", "items": _RESPONSES_TOOL}),
            "tool_choice": nullable(
                {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, OBJ]}
            ),
            "parallel_tool_calls": nullable(BOOL),
            "text": nullable(
                {
                    "type": "object",
                    "properties": {
                        "format": OBJ,
                        "verbosity": {"type": "string", "enum": list(responses_input.VERBOSITY)},
                    },
                }
            ),
            "include": nullable(
                {
                    "type": "array",
                    "items": {"type": "string", "enum": list(responses_input.INCLUDE_OK)},
                }
            ),
            "service_tier": nullable(
                {"type": "string", "enum": list(responses_input.SERVICE_TIERS)}
            ),
            "prompt_cache_key": nullable(STR),
            "client_metadata": nullable(OBJ),
            "reasoning": nullable(
                {
                    "type": "object",
                    "properties": {"effort": nullable(STR), "summary": nullable(STR)},
                }
            ),
            "metadata": nullable(OBJ),
        },
    },
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "model", "status", "output"],
        "properties": {
            "id": STR,
            "object": {"type": "string", "enum": ["response"]},
            "created_at": INT,
            "model": STR,
            "status": {"type": "string", "enum": ["completed", "incomplete", "failed"]},
            "output": {"type": "array", "items": _OUTPUT_ITEM},
            "usage": nullable(
                {
                    "type": "object",
                    "required": ["input_tokens", "output_tokens", "total_tokens"],
                    "properties": {
                        "input_tokens": INT,
                        "output_tokens": INT,
                        "total_tokens": INT,
                    },
                }
            ),
        },
    },
    "ResponseDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": STR, "object": STR, "deleted": BOOL},
    },
    "MessagesRequest": {
        "type": "object",
        "required": ["messages", "max_tokens"],
        "properties": {
            **_ANT_PROMPT,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop_sequences": {
                "type": "array",
                "items": {**STR, "minLength": 1},
                "maxItems": messages_fields.MAX_STOP_SEQUENCES,
            },
            "temperature": number_range(0, messages_input.MAX_TEMPERATURE),
            "top_p": number_range(*PROBABILITY_RANGE),
            "top_k": {"type": "integer", "minimum": 0},
            "stream": BOOL,
            "metadata": OBJ,
            "context_management": OBJ,
            "output_config": {
                "type": "object",
                "properties": {
                    "effort": {"type": "string", "enum": list(messages_fields.EFFORTS)},
                    "format": OBJ,
                },
            },
        },
    },
    "Message": {
        "type": "object",
        "required": ["id", "type", "role", "content", "stop_reason", "usage"],
        "properties": {
            "id": STR,
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]},
            "model": STR,
            "content": {"type": "array", "items": _ANT_BLOCK},
            "stop_reason": {
                "type": "string",
                "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"],
            },
            "stop_sequence": nullable(STR),
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens"],
                "properties": {
                    "input_tokens": INT,
                    "output_tokens": INT,
                    "cache_read_input_tokens": INT,
                    "cache_creation_input_tokens": INT,
                },
            },
        },
    },
    "CountTokensRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": _ANT_PROMPT,
    },
    "CountTokens": {
        "type": "object",
        "required": ["input_tokens"],
        "properties": {"input_tokens": INT},
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": STR, "message": STR},
            },
        },
    },
}

_SSE = {"schema": {"type": "object", "properties": {"event": STR, "data": STR}}}
_ANT_ERRORS = {
    "400": "invalid field (the message names it)",
    "401": "missing or wrong API key (x-api-key or Bearer, when a key is set)",
    "404": "unknown model",
    "413": "request body over the size limit",
    "415": "the body is not sent as application/json",
    "429": "every row busy and the queue full (see Retry-After)",
    "503": "the model is loading or the server is shutting down",
}


def _post(op: str, summary: str, request: str, response: str, error: str, stream: bool) -> dict:
    ok = json_response(response, "success")
    if stream:
        ok["content"]["text/event-stream"] = _SSE
    errors = {s: json_response(error, d) for s, d in _ANT_ERRORS.items()}
    if error == "Error":
        errors["404"] = json_response(error, "unknown model or previous_response_id")
    return post(op, summary, request, ok, errors)


def _by_id(op: str, summary: str, response: str, method: str) -> dict:
    return {
        method: {
            "operationId": op,
            "summary": summary,
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": STR}],
            "responses": {
                "200": json_response(response, "the stored response"),
                "401": json_response("Error", _ANT_ERRORS["401"]),
                "404": json_response("Error", "no stored response with this id"),
            },
        }
    }


def paths() -> dict[str, dict]:
    """The path items of the agent APIs."""
    by_id = _by_id("getResponse", "A stored response", "Response", "get")
    by_id |= _by_id("deleteResponse", "Delete a stored response", "ResponseDeleted", "delete")
    return {
        "/v1/responses": _post(
            "createResponse", "OpenAI Responses", "ResponsesRequest", "Response", "Error", True
        ),
        "/v1/responses/{response_id}": by_id,
        "/v1/messages": _post(
            "createMessage",
            "Anthropic Messages",
            "MessagesRequest",
            "Message",
            "AnthropicError",
            True,
        ),
        "/v1/messages/count_tokens": _post(
            "countTokens",
            "Prompt tokens of a Messages request",
            "CountTokensRequest",
            "CountTokens",
            "AnthropicError",
            False,
        ),
    }
