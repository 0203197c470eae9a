"""Translate an Anthropic `POST /v1/messages` body into the service's chat request.

`system` becomes a leading system message and `role: "system"` messages inside `messages` stay
where they stand or are folded into it, as the chat template allows (system.py);
`tool_use` blocks the assistant's `tool_calls`; `tool_result` blocks `tool` messages (each must
answer a `tool_use` of the assistant message just before); `thinking` blocks the assistant's
`reasoning_content`; the other fields as fields.py says. `parse_chat` then applies every
chat rule unchanged. Errors name the Anthropic field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llm_server.api.anthropic import fields as fields_of
from llm_server.api.anthropic.system import place_system
from llm_server.api.chat.run import parse_translated
from llm_server.api.shared.errors import invalid
from llm_server.api.shared.images import base64_ref, image_part, is_image_part
from llm_server.api.shared.sampling_fields import MAX_STOP_SEQUENCES as CHAT_MAX_STOPS
from llm_server.api.shared.schemas import ChatRequest
from llm_server.service import ModelService

MAX_TEMPERATURE = 1.0  # Anthropic's range is [0, 1]
UNSUPPORTED = {
    "container": "code-execution containers need Anthropic's servers",
    "mcp_servers": "MCP servers are not supported; give the tools as 'tools'",
}
SERVICE_TIERS = ("auto", "standard_only")  # one tier here: both mean it
CHAT_TO_MESSAGES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "reasoning_effort": "output_config.effort",
    "response_format": "output_config.format",
}
# Claude Code's attribution line (system[0]): it changes every request, so it would end the
# reused prompt prefix at the first system block; Anthropic reads it, the model never needs it
BILLING_HEADER = "x-anthropic-billing-header:"


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
    fields_of.check_metadata(body.get("metadata"))
    fields_of.check_context_management(body.get("context_management"))
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
    messages = place_system(service.tokenizer, _system(body.get("system")), messages)
    effort, response_format = fields_of.output_config(body)
    choice, parallel = fields_of.chat_tool_choice(body.get("tool_choice"))
    template_kwargs, budget = fields_of.thinking(
        body.get("thinking"), max_tokens, service, count_only
    )
    fields: dict[str, Any] = {
        "model": body.get("model"),
        "stream": body.get("stream"),
        "temperature": temperature,
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "max_completion_tokens": None if count_only else max_tokens,
        "stop": fields_of.stop_sequences(body.get("stop_sequences")),
        "tools": fields_of.chat_tools(body.get("tools")),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs,
        "reasoning_effort": effort,
        "response_format": response_format,
    }
    chat = parse_translated(messages, fields, service, messages_param)
    if len(body.get("stop_sequences") or ()) > CHAT_MAX_STOPS:  # parse_chat saw the first few
        chat = replace(chat, params=replace(chat.params, stop=tuple(body["stop_sequences"])))
    return replace(chat, thinking_budget=budget)


def messages_param(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function.parameters", ".input_schema").replace(".function", "")
    if param.startswith("messages["):
        return "messages"
    return CHAT_TO_MESSAGES.get(param, param)


def _system(system: Any, param: str = "system") -> str:
    """The system prompt: a string, or text blocks one after another (blank lines between);
    Claude Code's attribution block is left out (BILLING_HEADER)."""
    if system is None or isinstance(system, str):
        return system or ""
    if not isinstance(system, list):
        raise invalid(param, f"'{param}' must be a string or an array of text blocks")
    texts = [_text_block(b, f"{param}[{j}]") for j, b in enumerate(system)]
    return "\n\n".join(t for t in texts if not t.startswith(BILLING_HEADER))


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
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise invalid(f"{param}.role", "role must be 'user', 'assistant' or 'system'")
        content = m.get("content")
        if m["role"] == "system":  # where it stands or folded: place_system
            out.append({"role": "system", "content": _system(content, f"{param}.content")})
            continue
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
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a template can show
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
    results, parts = [], []
    for j, b in enumerate(blocks):
        where = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(b, where)})
        elif kind == "image":
            parts.append(image_part(base64_ref(b.get("source"), f"{where}.source")))
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
                f"user block type {kind!r} is not supported; send text, image or tool_result "
                "blocks",
            )
    if parts or not results:
        results.append({"role": "user", "content": _joined(parts)})
    return results


def _joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts as one string, as always; with an image, the parts in order."""
    if any(is_image_part(p) for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _result(block: dict, param: str) -> str | list[dict[str, Any]]:
    content = block.get("content")
    if content is None:
        content = ""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        content = [_result_part(b, f"{param}.content[{k}]") for k, b in enumerate(content)]
    else:
        raise invalid(
            f"{param}.content", "tool_result content must be a string or text and image blocks"
        )
    if block.get("is_error"):
        content = [{"type": "text", "text": "Error: "}, *content]
    return _joined(_merged(content))


def _merged(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neighbouring text parts as one (a tool result's text reads as it always did)."""
    out: list[dict[str, Any]] = []
    for p in parts:
        if out and p["type"] == "text" and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
        else:
            out.append(p)
    return out


def _result_part(block: Any, param: str) -> dict[str, Any]:
    """A tool_result's block as a part: Claude Code's Read tool answers with images, its tool
    search with `tool_reference` blocks (read as text); a document is named, not read."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "image":
        return image_part(base64_ref(block.get("source"), f"{param}.source"))
    if kind == "tool_reference":
        return {"type": "text", "text": f"Tool available: {block.get('tool_name')}\n"}
    if kind == "document":
        return {"type": "text", "text": "[document omitted: this model reads text only]\n"}
    return {"type": "text", "text": _text_block(block, param)}
