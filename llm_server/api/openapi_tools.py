"""OpenAPI pieces for tool calling and reasoning on /v1/chat/completions (used by openapi.py)."""

from __future__ import annotations

_STR = {"type": "string"}
_INT = {"type": "integer"}
_OBJ = {"type": "object"}

_FUNCTION_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": _STR,
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": _STR, "arguments": _STR},
        },
    },
}

# ChatCompletionRequest properties
REQUEST_FIELDS: dict[str, dict] = {
    "tools": {
        "type": "array",
        "nullable": True,
        "items": {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                        "description": _STR,
                        "parameters": _OBJ,
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
    },
    "tool_choice": {
        "nullable": True,
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": _STR},
                    },
                },
            },
        ],
    },
    "parallel_tool_calls": {"type": "boolean", "nullable": True},
    "chat_template_kwargs": {"type": "object", "nullable": True},
    "reasoning_effort": {
        "type": "string",
        "nullable": True,
        "enum": ["minimal", "low", "medium", "high"],
    },
}

# ChatMessage properties (history of calls and their results)
MESSAGE_FIELDS: dict[str, dict] = {
    "tool_calls": {"type": "array", "items": _FUNCTION_CALL},
    "tool_call_id": _STR,
    "name": _STR,
}

# the response message
RESPONSE_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["assistant"]},
        "content": {**_STR, "nullable": True},
        "tool_calls": {"type": "array", "items": _FUNCTION_CALL},
        "reasoning_content": {**_STR, "nullable": True},
        "reasoning": {**_STR, "nullable": True},
    },
}
CHAT_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
COMPLETION_DETAILS = {"type": "object", "properties": {"reasoning_tokens": _INT}}
