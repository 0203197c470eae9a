"""Translate a `POST /v1/responses` body into the service's chat request (400s name the field).

Input items become chat messages (items.py), tools chat tools (tools.py:
namespaces flattened, custom tools as one-string functions, hosted tools dropped); `text.format`,
`reasoning.effort` and `max_output_tokens` become their chat fields. Without
`max_output_tokens` an answer may run to the end of the context, as on OpenAI. `parse_chat`
then applies every chat rule (sampling ranges, tool specs, template kwargs) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_server.api.chat.run import parse_translated
from llm_server.api.openai.responses.items import input_messages
from llm_server.api.openai.responses.tools import ToolMap, chat_tool_choice, chat_tools
from llm_server.api.shared.errors import APIError, invalid
from llm_server.api.shared.schemas import ChatRequest
from llm_server.service import ModelService

INCLUDE_OK = ("reasoning.encrypted_content",)  # accepted: reasoning items carry their text
# Responses fields this server refuses (a client relying on them gets a 400 naming them).
UNSUPPORTED = {
    "background": "background responses are not supported; send the request and wait",
    "conversation": "'conversation' objects are not supported; use 'previous_response_id'",
    "prompt": "stored prompt templates ('prompt') are not supported; send 'input'",
    "max_tool_calls": "'max_tool_calls' is not supported; use 'parallel_tool_calls': false",
    "top_logprobs": "'top_logprobs' is not supported on /v1/responses; use chat completions",
}
# accepted without effect: one tier here (the response says 'default', the tier that ran it)
SERVICE_TIERS = ("auto", "default", "flex", "priority", "scale")
VERBOSITY = ("low", "medium", "high")  # accepted without effect: the model's own length
# efforts above 'high' (Codex's 'xhigh') as the highest chat templates know
EFFORTS = {"xhigh": "high", "max": "high"}
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
    tools: ToolMap  # chat calls back to Responses items; the hosted tools left out

    def param(self, param: str | None) -> str | None:
        """The Responses field a chat field's error is about."""
        return responses_param(param, self.tools)


def _check_fields(body: dict) -> None:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, 0):
            raise invalid(key, why)
    _check_include(body.get("include"))
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise invalid("service_tier", f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid("user", "'user' must be a string")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("truncation", "only 'truncation': 'disabled' is supported")
    if body.get("prompt_cache_key") is not None and not isinstance(body["prompt_cache_key"], str):
        raise invalid("prompt_cache_key", "'prompt_cache_key' must be a string")
    meta = body.get("client_metadata")
    if meta is not None and not isinstance(meta, dict):
        raise invalid("client_metadata", "'client_metadata' must be an object")


def parse_responses(
    body: dict,
    service: ModelService,
    previous: tuple[dict[str, Any], ...] = (),
    previous_cut: frozenset[str] = frozenset(),
) -> ResponsesRequest:
    """`body` (with the stored conversation `previous`) as a ResponsesRequest, or a 400.
    `previous_cut`: the ids of calls the previous response left incomplete (not stored)."""
    _check_fields(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "'instructions' must be a string")
    raw = body.get("input")
    if raw is None or raw == "" or raw == []:
        raise invalid("input", "'input' is required: a string or an array of input items")
    known = {c["id"] for m in previous for c in m.get("tool_calls", ())}
    new, reasoning = input_messages(raw, known, previous_cut)
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
    tools, tmap = chat_tools(body.get("tools"))
    max_output = body.get("max_output_tokens")
    fields: dict[str, Any] = {
        "model": body.get("model"),
        "stream": body.get("stream"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        # none asked: up to the end of the context (the decoder stops where the row is full)
        "max_completion_tokens": service.context_length if max_output is None else max_output,
        "response_format": text_format,
        "reasoning_effort": None if effort == "none" else EFFORTS.get(effort, effort),
        "chat_template_kwargs": template_kwargs,
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "tools": tools,
        "tool_choice": chat_tool_choice(body.get("tool_choice"), tmap),
    }
    chat = parse_translated(messages, fields, service, lambda p: responses_param(p, tmap))
    store = True if body.get("store") is None else body["store"]
    if not isinstance(store, bool):
        raise invalid("store", "'store' must be a boolean")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise invalid("metadata", "'metadata' must be an object")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "metadata": metadata,
        "parallel_tool_calls": chat.tools.parallel,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": effort, "summary": summary},
        "service_tier": "default",
        "temperature": chat.params.temperature,
        "text": {"format": _echo_format(body.get("text")), "verbosity": _verbosity(body)},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": chat.params.top_p,
        "truncation": "disabled",
        "user": body.get("user"),
    }
    if body.get("prompt_cache_key") is not None:
        echo["prompt_cache_key"] = body["prompt_cache_key"]
    return ResponsesRequest(chat, history, echo, store, bool(summary), tmap)


def _verbosity(body: dict) -> str:
    text = body.get("text")
    return (text.get("verbosity") if isinstance(text, dict) else None) or "medium"


def _echo_format(text: dict | None) -> dict:
    """`text.format` as the request gave it (validated by _text_format)."""
    fmt = (text or {}).get("format")
    return fmt if isinstance(fmt, dict) else {"type": "text"}


def responses_param(param: str | None, tools: ToolMap | None = None) -> str | None:
    """The Responses field a chat field's error is about (`tools[k]` through the map)."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param.startswith("tools["):
        if tools is not None and tools.params:
            return tools.param(param)
        return param.replace(".function", "", 1)
    return CHAT_TO_RESPONSES.get(param, param)


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("include", "'include' must be an array of strings")
    for x in include:
        if x not in INCLUDE_OK:
            raise invalid("include", f"'include' value {x!r} is not supported")


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("text", "'text' must be an object")
    if text.get("verbosity") not in (None, *VERBOSITY):
        raise invalid("text.verbosity", f"'text.verbosity' must be one of {', '.join(VERBOSITY)}")
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


def unknown_response(rid: str, param: str | None = None) -> APIError:
    """404 for a response id the store does not hold (never stored, evicted or deleted)."""
    return APIError(
        404, f"no response with id {rid!r} is stored on this server", param=param, code="not_found"
    )
