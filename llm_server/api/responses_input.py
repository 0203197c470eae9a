"""Translate a `POST /v1/responses` body into the service's chat request (400s name the field).

Input items become chat messages (`instructions` a leading system message, `function_call`
items the assistant's `tool_calls`, `function_call_output` items `tool` messages, `reasoning`
items the next assistant message's `reasoning_content`); `tools`, `tool_choice`, `text.format`,
`reasoning.effort` and `max_output_tokens` become their chat fields. `parse_chat` then applies
every chat rule (sampling ranges, tool specs, template kwargs) unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llm_server.api.chat_run import parse_translated
from llm_server.api.errors import APIError, invalid
from llm_server.api.schemas import ChatRequest
from llm_server.service import ModelService

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
INCLUDE_OK = ("reasoning.encrypted_content",)  # accepted: reasoning items carry their text
# Responses fields this server refuses (a client relying on them gets a 400 naming them).
UNSUPPORTED = {
    "background": "background responses are not supported; send the request and wait",
    "conversation": "'conversation' objects are not supported; use 'previous_response_id'",
    "prompt": "stored prompt templates ('prompt') are not supported; send 'input'",
    "max_tool_calls": "'max_tool_calls' is not supported; use 'parallel_tool_calls': false",
    "top_logprobs": "'top_logprobs' is not supported on /v1/responses; use chat completions",
}
SERVICE_TIERS = ("auto", "default")  # one tier here; 'flex' and 'priority' need OpenAI's
# chat field -> the Responses field a parse_chat error is about
CHAT_TO_RESPONSES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "reasoning_effort": "reasoning.effort",
}


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated Responses request: the chat request to run and what the response echoes."""

    chat: ChatRequest
    history: tuple[dict[str, Any], ...]  # the conversation without instructions (stored)
    echo: dict[str, Any]  # request fields the response object repeats
    store: bool
    summary: bool  # reasoning.summary asked: the thinking is also given as summary_text


def parse_responses(
    body: dict, service: ModelService, previous: tuple[dict[str, Any], ...] = ()
) -> ResponsesRequest:
    """`body` (with the stored conversation `previous`) as a ResponsesRequest, or a 400."""
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, 0):
            raise invalid(key, why)
    _check_include(body.get("include"))
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise invalid("service_tier", "'service_tier' must be 'auto' or 'default' (one tier here)")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "'user' must be a string")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise invalid("truncation", "only 'truncation': 'disabled' is supported")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "'instructions' must be a string")
    raw = body.get("input")
    if raw is None or raw == "" or raw == []:
        raise invalid("input", "'input' is required: a string or an array of input items")
    known = {c["id"] for m in previous for c in m.get("tool_calls", ())}
    new, reasoning = input_messages(raw, known)
    for i, text in reasoning.items():
        new[i]["reasoning_content"] = text
    history = previous + tuple(new)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += list(history)
    text_format = _text_format(body.get("text"))
    effort, summary = _reasoning(body.get("reasoning"))
    template_kwargs = None
    if effort == "none":  # no thinking at all: the template's switch, where it has one
        if service.syntax.reasoning == "harmony":
            raise invalid("reasoning.effort", "this model always reasons; use 'low'")
        if service.syntax.reasoning == "think":
            template_kwargs = {"enable_thinking": False}
    fields: dict[str, Any] = {
        "model": body.get("model"),
        "stream": body.get("stream"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "response_format": text_format,
        "reasoning_effort": None if effort == "none" else effort,
        "chat_template_kwargs": template_kwargs,
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "tools": _tools(body.get("tools")),
        "tool_choice": _tool_choice(body.get("tool_choice")),
    }
    chat = parse_translated(messages, fields, service, responses_param)
    store = True if body.get("store") is None else body["store"]
    if not isinstance(store, bool):
        raise invalid("store", "'store' must be a boolean")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise invalid("metadata", "'metadata' must be an object")
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": chat.tools.parallel,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": effort, "summary": summary},
        "temperature": chat.params.temperature,
        "text": {"format": _echo_format(body.get("text"))},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": chat.params.top_p,
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(chat, history, echo, store, bool(summary))


def _echo_format(text: dict | None) -> dict:
    """`text.format` as the request gave it (validated by _text_format)."""
    fmt = (text or {}).get("format")
    return fmt if isinstance(fmt, dict) else {"type": "text"}


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat field's error is about."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "")
    return CHAT_TO_RESPONSES.get(param, param)


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("include", "'include' must be an array of strings")
    for x in include:
        if x not in INCLUDE_OK:
            raise invalid("include", f"'include' value {x!r} is not supported")


def input_messages(raw: Any, known_calls: set[str]) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Chat messages for `input`, and the reasoning text of assistant messages by index.

    `known_calls`: call ids of earlier turns a `function_call_output` may answer."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], {}
    if not isinstance(raw, list):
        raise invalid("input", "'input' must be a string or an array of input items")
    out: list[dict[str, Any]] = []
    reasoning: dict[int, str] = {}
    pending = ""  # reasoning waiting for the assistant message it belongs to
    calls = set(known_calls)
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(param, f"{param} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{param}.role", f"role must be one of {', '.join(ROLES)}")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
            if role == "assistant" and pending:
                reasoning[len(out) - 1], pending = pending, ""
        elif kind == "function_call":
            call = _call(item, param)
            calls.add(call["id"])
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
                last = out[-1]
            last.setdefault("tool_calls", []).append(call)
            if pending:
                reasoning[len(out) - 1], pending = pending, ""
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise invalid(
                    f"{param}.call_id",
                    f"no function_call with call_id {cid!r} precedes this function_call_output",
                )
            out.append(
                {"role": "tool", "tool_call_id": cid, "content": _output(item, f"{param}.output")}
            )
        elif kind == "reasoning":
            pending += _reasoning_text(item, param)
        else:
            raise invalid(
                f"{param}.type",
                f"input item type {kind!r} is not supported; send message, function_call, "
                "function_call_output or reasoning items",
            )
    return out, reasoning


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or an array of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS:
            raise invalid(
                f"{param}[{j}].type",
                f"content part type {kind!r} is not supported; only input_text and output_text",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{param}[{j}].text", "a text part needs a string 'text'")
        parts.append(text)
    return "".join(parts)


def _call(item: dict, param: str) -> dict[str, Any]:
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(cid, str) or not cid:
        raise invalid(f"{param}.call_id", "a function_call item needs a string 'call_id'")
    if not isinstance(name, str) or not name:
        raise invalid(f"{param}.name", "a function_call item needs a string 'name'")
    if not isinstance(args, str):
        raise invalid(f"{param}.arguments", "'arguments' must be a JSON object string")
    try:
        parsed = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(f"{param}.arguments", "'arguments' must be a JSON object string")
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _output(item: dict, param: str) -> str:
    output = item.get("output")
    if isinstance(output, list):
        return _text(output, param)
    if not isinstance(output, str):
        raise invalid(param, f"'{param}' must be a string or an array of text parts")
    return output


def _reasoning_text(item: dict, param: str) -> str:
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise invalid(f"{param}.{key}", f"'{param}.{key}' must be an array")
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or not isinstance(p.get("text"), str):
                raise invalid(f"{param}.{key}[{j}]", "a reasoning part needs a string 'text'")
            texts.append(p["text"])
        if texts:  # the full reasoning text when given, else its summary
            break
    return "\n".join(texts)


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("text", "'text' must be an object")
    verbosity = text.get("verbosity")
    if verbosity not in (None, "medium"):
        raise invalid("text.verbosity", "'text.verbosity' is not supported; only 'medium'")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid("text.format.schema", "a json_schema format needs a 'schema' object")
        spec = {"name": fmt.get("name") or "output", "schema": schema}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("text.format.type", "text.format.type must be text, json_object or json_schema")


def _reasoning(reasoning: Any) -> tuple[str | None, str | None]:
    if reasoning is None:
        return None, None
    if not isinstance(reasoning, dict):
        raise invalid("reasoning", "'reasoning' must be an object")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary not in (None, "auto", "concise", "detailed"):
        raise invalid("reasoning.summary", "reasoning.summary must be auto, concise or detailed")
    return reasoning.get("effort"), summary


def _tools(tools: Any) -> list | None:
    """Responses function tools (flat) in the chat shape; other tool types are refused."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be an array of function tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise invalid(
                f"tools[{i}].type",
                f"tool type {kind!r} is not supported; only 'function' tools (built-in tools "
                "need OpenAI's servers)",
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        fn["strict"] = t.get("strict", True)  # the Responses default
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise invalid(
        "tool_choice",
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        '"name": ...}',
    )


def unknown_response(rid: str, param: str | None = None) -> APIError:
    """404 for a response id the store does not hold (never stored, evicted or deleted)."""
    return APIError(
        404, f"no response with id {rid!r} is stored on this server", param=param, code="not_found"
    )
