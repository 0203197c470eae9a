"""OpenAPI pieces for /v1/responses and /v1/messages (merged into the document by openapi.py)."""

from __future__ import annotations

_STR = {"type": "string"}
_INT = {"type": "integer"}
_OBJ = {"type": "object"}
_BOOL = {"type": "boolean"}


def _n(schema: dict) -> dict:
    return {**schema, "nullable": True}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"type": "string", "enum": ["input_text", "output_text"]},
        "text": _STR,
    },
}
_INPUT_ITEM = {
    "type": "object",
    "description": "a message (role + content), function_call, function_call_output or "
    "reasoning item",
    "properties": {
        "type": {
            "type": "string",
            "enum": ["message", "function_call", "function_call_output", "reasoning"],
        },
        "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        "call_id": _STR,
        "name": _STR,
        "arguments": _STR,
        "output": _STR,
    },
}
_OUTPUT_ITEM = {
    "type": "object",
    "required": ["id", "type"],
    "properties": {
        "id": _STR,
        "type": {"type": "string", "enum": ["message", "function_call", "reasoning"]},
        "status": _STR,
        "role": _STR,
        "content": {"type": "array", "items": _OBJ},
        "summary": {"type": "array", "items": _OBJ},
        "call_id": _STR,
        "name": _STR,
        "arguments": _STR,
    },
}
_ANT_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking"]},
        "text": _STR,
        "id": _STR,
        "name": _STR,
        "input": _OBJ,
        "tool_use_id": _STR,
        "content": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
        "thinking": _STR,
    },
}
_ANT_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["user", "assistant"]},
            "content": {"oneOf": [_STR, {"type": "array", "items": _ANT_BLOCK}]},
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
            "description": _STR,
            "input_schema": _OBJ,
        },
    },
}
_ANT_PROMPT = {
    "model": _STR,
    "system": {"oneOf": [_STR, {"type": "array", "items": _OBJ}]},
    "messages": _ANT_MESSAGES,
    "tools": _ANT_TOOLS,
    "tool_choice": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]},
            "name": _STR,
            "disable_parallel_tool_use": _BOOL,
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
            "model": _STR,
            "input": {"oneOf": [{**_STR, "minLength": 1}, {"type": "array", "items": _INPUT_ITEM}]},
            "instructions": _n(_STR),
            "previous_response_id": _n(_STR),
            "store": _n(_BOOL),
            "stream": _n(_BOOL),
            "max_output_tokens": _n({"type": "integer", "minimum": 1}),
            "temperature": _n({"type": "number", "minimum": 0, "maximum": 2}),
            "top_p": _n({"type": "number", "minimum": 0, "maximum": 1}),
            "tools": _n({"type": "array", "items": _OBJ}),
            "tool_choice": _n(
                {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, _OBJ]}
            ),
            "parallel_tool_calls": _n(_BOOL),
            "text": _n({"type": "object", "properties": {"format": _OBJ}}),
            "reasoning": _n(
                {"type": "object", "properties": {"effort": _n(_STR), "summary": _n(_STR)}}
            ),
            "metadata": _n(_OBJ),
        },
    },
    "Response": {
        "type": "object",
        "required": ["id", "object", "created_at", "model", "status", "output"],
        "properties": {
            "id": _STR,
            "object": {"type": "string", "enum": ["response"]},
            "created_at": _INT,
            "model": _STR,
            "status": {"type": "string", "enum": ["completed", "incomplete", "failed"]},
            "output": {"type": "array", "items": _OUTPUT_ITEM},
            "usage": _n(
                {
                    "type": "object",
                    "required": ["input_tokens", "output_tokens", "total_tokens"],
                    "properties": {
                        "input_tokens": _INT,
                        "output_tokens": _INT,
                        "total_tokens": _INT,
                    },
                }
            ),
        },
    },
    "ResponseDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": _STR, "object": _STR, "deleted": _BOOL},
    },
    "MessagesRequest": {
        "type": "object",
        "required": ["messages", "max_tokens"],
        "properties": {
            **_ANT_PROMPT,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stop_sequences": {"type": "array", "items": {**_STR, "minLength": 1}, "maxItems": 16},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "stream": _BOOL,
            "metadata": _OBJ,
        },
    },
    "Message": {
        "type": "object",
        "required": ["id", "type", "role", "content", "stop_reason", "usage"],
        "properties": {
            "id": _STR,
            "type": {"type": "string", "enum": ["message"]},
            "role": {"type": "string", "enum": ["assistant"]},
            "model": _STR,
            "content": {"type": "array", "items": _ANT_BLOCK},
            "stop_reason": {
                "type": "string",
                "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"],
            },
            "stop_sequence": _n(_STR),
            "usage": {
                "type": "object",
                "required": ["input_tokens", "output_tokens"],
                "properties": {
                    "input_tokens": _INT,
                    "output_tokens": _INT,
                    "cache_read_input_tokens": _INT,
                    "cache_creation_input_tokens": _INT,
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
        "properties": {"input_tokens": _INT},
    },
    "AnthropicError": {
        "type": "object",
        "required": ["type", "error"],
        "properties": {
            "type": {"type": "string", "enum": ["error"]},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {"type": _STR, "message": _STR},
            },
        },
    },
}

_SSE = {"schema": {"type": "object", "properties": {"event": _STR, "data": _STR}}}
_ANT_ERRORS = {
    "400": "invalid field (the message names it)",
    "401": "missing or wrong API key (x-api-key or Bearer, when a key is set)",
    "404": "unknown model",
    "413": "request body over the size limit",
    "415": "the body is not sent as application/json",
    "429": "every row busy and the queue full (see Retry-After)",
    "503": "the model is loading or the server is shutting down",
}


def _json(name: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _post(op: str, summary: str, request: str, response: str, error: str, stream: bool) -> dict:
    ok = _json(response, "success")
    if stream:
        ok["content"]["text/event-stream"] = _SSE
    errors = {s: _json(error, d) for s, d in _ANT_ERRORS.items()}
    if error == "Error":
        errors["404"] = _json(error, "unknown model or previous_response_id")
    return {
        "post": {
            "operationId": op,
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": ok, **errors},
        }
    }


def _by_id(op: str, summary: str, response: str, method: str) -> dict:
    return {
        method: {
            "operationId": op,
            "summary": summary,
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": _STR}],
            "responses": {
                "200": _json(response, "the stored response"),
                "401": _json("Error", _ANT_ERRORS["401"]),
                "404": _json("Error", "no stored response with this id"),
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
