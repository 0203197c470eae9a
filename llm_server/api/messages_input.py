"""Translate an Anthropic `POST /v1/messages` body into the service's chat request.

`system` becomes a leading system message; `tool_use` blocks the assistant's `tool_calls`;
`tool_result` blocks `tool` messages (each must answer a `tool_use` of the assistant message
just before); `thinking` blocks the assistant's `reasoning_content`; `tools` (`input_schema`),
`tool_choice` (auto/any/tool/none), `stop_sequences`, `top_k` and `thinking` their chat fields.
`metadata.user_id` and `service_tier` (one tier) are checked and need nothing more here.
`parse_chat` then applies every chat rule unchanged. Errors name the Anthropic field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llm_server.api.chat_run import parse_translated
from llm_server.api.errors import invalid
from llm_server.api.sampling_fields import MAX_STOP_LENGTH
from llm_server.api.sampling_fields import MAX_STOP_SEQUENCES as CHAT_MAX_STOPS
from llm_server.api.schemas import ChatRequest
from llm_server.service import ModelService

MIN_THINKING_BUDGET = 1  # Anthropic asks for 1024 or more; smaller budgets work here too
MAX_STOP_SEQUENCES = 16
MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]
UNSUPPORTED = {
    "container": "code-execution containers need Anthropic's servers",
    "mcp_servers": "MCP servers are not supported; give the tools as 'tools'",
    "output_format": "'output_format' is not supported on this server",
}
SERVICE_TIERS = ("auto", "standard_only")  # one tier here: both mean it
CHAT_TO_MESSAGES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}


def parse_messages_request(
    body: dict, service: ModelService, count_only: bool = False
) -> ChatRequest:
    """`body` as a ChatRequest, or a 400 naming the field. `count_only`: /count_tokens (no
    max_tokens needed)."""
    for key, why in UNSUPPORTED.items():
        if body.get(key) is not None:
            raise invalid(key, why)
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise invalid("service_tier", "'service_tier' must be 'auto' or 'standard_only'")
    _metadata(body.get("metadata"))
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count_only:
        raise invalid("max_tokens", "'max_tokens' is required")
    if not count_only and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise invalid("max_tokens", "'max_tokens' must be an integer of at least 1")
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float) or not 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise invalid(
            "temperature", f"'temperature' must be a number between 0 and {MAX_TEMPERATURE:g}"
        )
    messages = chat_messages(body.get("messages"))
    system = _system(body.get("system"))
    if system:
        messages.insert(0, {"role": "system", "content": system})
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    template_kwargs, budget = _thinking(body.get("thinking"), max_tokens, service, count_only)
    fields: dict[str, Any] = {
        "model": body.get("model"),
        "stream": body.get("stream"),
        "temperature": temperature,
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "max_completion_tokens": None if count_only else max_tokens,
        "stop": _stop_sequences(body.get("stop_sequences")),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs,
    }
    chat = parse_translated(messages, fields, service, _renamed)
    if len(body.get("stop_sequences") or ()) > CHAT_MAX_STOPS:  # parse_chat saw the first few
        chat = replace(chat, params=replace(chat.params, stop=tuple(body["stop_sequences"])))
    return replace(chat, thinking_budget=budget)


def _metadata(metadata: Any) -> None:
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


def _renamed(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function.parameters", ".input_schema").replace(".function", "")
    if param.startswith("messages["):
        return "messages"
    return CHAT_TO_MESSAGES.get(param, param)


def _system(system: Any) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise invalid("system", "'system' must be a string or an array of text blocks")
    return "".join(_text_block(b, f"system[{j}]") for j, b in enumerate(system))


def _text_block(block: Any, param: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
        raise invalid(f"{param}.type", f"block type {kind!r} is not supported here; only 'text'")
    if not isinstance(block.get("text"), str):
        raise invalid(f"{param}.text", "a text block needs a string 'text'")
    return block["text"]


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    """Chat messages for Anthropic `messages` (thinking blocks as `reasoning_content`)."""
    if raw is None:
        raise invalid("messages", "'messages' is required")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "'messages' must be a non-empty array")
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # tool_use ids of the assistant message just before
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{param}.role", "role must be 'user' or 'assistant'")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{param}.content", "'content' must be a string or an array of blocks")
        if m["role"] == "assistant":
            msg, thinking, open_calls = _assistant(blocks, param)
            if thinking:  # to the template as reasoning_content (after validation)
                msg["reasoning_content"] = thinking
            out.append(msg)
        else:
            out += _user(blocks, param, open_calls)
            open_calls = set()
    if raw[-1].get("role") == "assistant":
        raise invalid(
            f"messages[{len(raw) - 1}]",
            "a final assistant message (prefill) is not supported; end with a user message",
        )
    return out


def _assistant(blocks: list, param: str) -> tuple[dict[str, Any], str, set[str]]:
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(_text_block(b, where))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise invalid(f"{where}.thinking", "a thinking block needs a string 'thinking'")
            thinking.append(b["thinking"])
        elif kind == "tool_use":
            cid, name, args = b.get("id"), b.get("name"), b.get("input")
            if not isinstance(cid, str) or not cid or not isinstance(name, str):
                raise invalid(where, "a tool_use block needs a string 'id' and 'name'")
            if not isinstance(args, dict):
                raise invalid(f"{where}.input", "a tool_use block's 'input' must be an object")
            calls.append(
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            )
        else:
            raise invalid(
                f"{where}.type",
                f"assistant block type {kind!r} is not supported; send text, thinking or tool_use",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return msg, "\n".join(thinking), {c["id"] for c in calls}


def _user(blocks: list, param: str, open_calls: set[str]) -> list[dict[str, Any]]:
    results, text = [], []
    for j, b in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(_text_block(b, where))
        elif kind == "tool_result":
            cid = b.get("tool_use_id")
            if not isinstance(cid, str) or cid not in open_calls:
                raise invalid(
                    f"{where}.tool_use_id",
                    f"tool_result block {cid!r} answers no tool_use block of the previous "
                    "assistant message",
                )
            results.append({"role": "tool", "tool_call_id": cid, "content": _result(b, where)})
        else:
            raise invalid(
                f"{where}.type",
                f"user block type {kind!r} is not supported; send text or tool_result blocks",
            )
    if text or not results:
        results.append({"role": "user", "content": "".join(text)})
    return results


def _result(block: dict, param: str) -> str:
    content = block.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{param}.content[{k}]") for k, b in enumerate(content))
    if not isinstance(content, str):
        raise invalid(f"{param}.content", "tool_result content must be a string or text blocks")
    if block.get("is_error"):
        return f"Error: {content}"
    return content


def _tools(tools: Any) -> list | None:
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
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
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


def _stop_sequences(stops: Any) -> list | None:
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


def _thinking(
    thinking: Any, max_tokens: Any, service: ModelService, count_only: bool
) -> tuple[dict[str, Any] | None, int | None]:
    """`thinking` as the template's `enable_thinking` (None: the template's default) and the
    thinking budget (enforced for `<think>` templates: chat_plan forces `</think>`)."""
    if thinking is None:
        return None, None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return ({"enable_thinking": False} if service.syntax.reasoning == "think" else None), None
    if kind not in ("enabled", "adaptive"):
        raise invalid("thinking.type", "thinking.type must be 'enabled', 'adaptive' or 'disabled'")
    if service.syntax.reasoning is None:
        raise invalid(
            "thinking", "this model does not think (its chat template has no thinking section)"
        )
    if kind == "adaptive":  # the model decides how long to think: the template's default
        return None, None
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        raise invalid(
            "thinking.budget_tokens",
            f"thinking.budget_tokens must be an integer of at least {MIN_THINKING_BUDGET}",
        )
    if not count_only and isinstance(max_tokens, int) and budget >= max_tokens:
        raise invalid("thinking.budget_tokens", "thinking.budget_tokens must be below max_tokens")
    if service.syntax.reasoning != "think":
        return None, None  # harmony (gpt-oss) always reasons; its length follows reasoning_effort
    return {"enable_thinking": True}, budget
