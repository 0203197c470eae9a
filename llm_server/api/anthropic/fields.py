"""The Anthropic request fields around `messages`, each as its chat field or checked and accepted.

`tools` (`input_schema`, `strict`), `tool_choice` (auto/any/tool/none), `stop_sequences` and
`thinking` become their chat fields; `output_config.effort` the template's `reasoning_effort`,
`output_config.format` (and the older `output_format`) a `json_schema` response format.
`metadata.user_id`, `context_management` and `cache_control` on any block are checked and need
nothing more here (README: the prefix cache is automatic; the server keeps no context to edit).
Errors name the Anthropic field.
"""

from __future__ import annotations

from typing import Any

from llm_server.api.shared.errors import invalid
from llm_server.api.shared.sampling_fields import MAX_STOP_LENGTH
from llm_server.api.shared.sampling_fields import MAX_STOP_SEQUENCES as CHAT_MAX_STOPS
from llm_server.service import ModelService

MIN_THINKING_BUDGET = 1  # Anthropic asks for 1024 or more; smaller budgets work here too
MAX_STOP_SEQUENCES = 16
# Anthropic's effort levels as the chat template's reasoning_effort (gpt-oss reads it)
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def check_metadata(metadata: Any) -> None:
    """Anthropic's `metadata` holds only `user_id` (an opaque id, nothing to do with it here)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise invalid("metadata", "'metadata' must be an object")
    for key, value in metadata.items():
        if key != "user_id":
            raise invalid(f"metadata.{key}", f"'metadata.{key}' is not supported; only user_id")
        if value is not None and not isinstance(value, str):
            raise invalid("metadata.user_id", "'metadata.user_id' must be a string")


def check_context_management(value: Any) -> None:
    """`context_management` edits (clear old thinking / tool results) are accepted without
    effect: the client sends the whole history every turn and it is rendered as sent."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("context_management", "'context_management' must be an object")
    edits = value.get("edits")
    if edits is not None and not (
        isinstance(edits, list) and all(isinstance(e, dict) for e in edits)
    ):
        raise invalid("context_management.edits", "'context_management.edits' must be an array")


def output_config(body: dict) -> tuple[str | None, dict | None]:
    """(`reasoning_effort`, `response_format`) for `output_config` / `output_format`."""
    config = body.get("output_config")
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise invalid("output_config", "'output_config' must be an object")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(
            "output_config.effort", f"'output_config.effort' must be one of {', '.join(EFFORTS)}"
        )
    fmt, param = config.get("format"), "output_config.format"
    if fmt is None:
        fmt, param = body.get("output_format"), "output_format"
    return EFFORTS.get(effort or ""), _format(fmt, param)


def _format(fmt: Any, param: str) -> dict | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid(f"{param}.type", f"'{param}.type' must be 'json_schema'")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid(f"{param}.schema", f"'{param}.schema' must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def chat_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be an array")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid(
                f"tools[{i}].type",
                f"tool type {kind!r} is not supported; only client tools with an input_schema",
            )
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"tools[{i}].input_schema", "a tool needs an 'input_schema' object")
        fn = {"name": t.get("name"), "parameters": schema}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        if isinstance(t.get("strict"), bool):
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none"}
    parallel = False if kind is not None and choice.get("disable_parallel_tool_use") else None
    if kind in modes:
        return modes[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise invalid(
        "tool_choice",
        '\'tool_choice\' must be {"type": "auto" | "any" | "none"} or '
        '{"type": "tool", "name": ...}',
    )


def stop_sequences(stops: Any) -> list | None:
    if stops is None:
        return None
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences", "'stop_sequences' must be an array of non-empty strings")
    if len(stops) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_LENGTH for s in stops):
        raise invalid(
            "stop_sequences",
            f"at most {MAX_STOP_SEQUENCES} stop sequences of {MAX_STOP_LENGTH} characters",
        )
    return stops[:CHAT_MAX_STOPS] or None  # the rest are set after parse_chat (OpenAI's limit)


def thinking(
    value: Any, max_tokens: Any, service: ModelService, count_only: bool
) -> tuple[dict[str, Any] | None, int | None]:
    """`thinking` as the template's `enable_thinking` (None: the template's default) and the
    thinking budget (enforced for `<think>` templates: chat/plan.py forces `</think>`). On a model
    that does not think, `enabled` and `adaptive` answer without thinking blocks."""
    if value is None:
        return None, None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return ({"enable_thinking": False} if service.syntax.reasoning == "think" else None), None
    if kind not in ("enabled", "adaptive"):
        raise invalid("thinking.type", "thinking.type must be 'enabled', 'adaptive' or 'disabled'")
    if kind == "adaptive":  # the model decides how long to think: the template's default
        return None, None
    budget = value.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise invalid(
            "thinking.budget_tokens",
            f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}",
        )
    if not count_only and isinstance(max_tokens, int) and budget >= max_tokens:
        raise invalid("thinking.budget_tokens", "thinking.budget_tokens must be below max_tokens")
    if service.syntax.reasoning != "think":
        return None, None  # no thinking (plain), or harmony's length follows reasoning_effort
    return {"enable_thinking": True}, budget
