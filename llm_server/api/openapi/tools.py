"""OpenAPI pieces for tool calling and reasoning on /v1/chat/completions (used by document.py)."""

from __future__ import annotations

from llm_server.api.openapi.blocks import INT, OBJ, STR


def _function(required: list[str], properties: dict) -> dict:
    """{"type": "function", "function": {...}}: a tool, a tool choice or a call."""
    return {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": required, "properties": properties},
        },
    }


_CALL = _function(["name", "arguments"], {"name": STR, "arguments": STR})
_FUNCTION_CALL = {
    **_CALL,
    "required": ["id", *_CALL["required"]],
    "properties": {"id": STR, **_CALL["properties"]},
}

# ChatCompletionRequest properties
REQUEST_FIELDS: dict[str, dict] = {
    "tools": {
        "type": "array",
        "nullable": True,
        "items": _function(
            ["name"],
            {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": STR,
                "parameters": OBJ,
                "strict": {"type": "boolean"},
            },
        ),
    },
    "tool_choice": {
        "nullable": True,
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            _function(["name"], {"name": STR}),
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
    "tool_call_id": STR,
    "name": STR,
}

# the response message
RESPONSE_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["assistant"]},
        "content": {**STR, "nullable": True},
        "tool_calls": {"type": "array", "items": _FUNCTION_CALL},
        "reasoning_content": {**STR, "nullable": True},
        "reasoning": {**STR, "nullable": True},
    },
}
CHAT_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
COMPLETION_DETAILS = {
    "type": "object",
    "properties": {
        "reasoning_tokens": INT,
        "accepted_prediction_tokens": INT,  # with `prediction` (predicted outputs)
        "rejected_prediction_tokens": INT,
    },
}
