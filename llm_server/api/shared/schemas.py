"""Parse and validate OpenAI request bodies into plain request objects (400 on bad input)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llm_server.api.shared.errors import invalid
from llm_server.api.shared.images import check_detail, image_part, is_image_part, url_ref
from llm_server.api.shared.sampling_fields import (
    OPENAI_DEFAULTS,
    get_field,
    max_tokens_field,
    parse_n,
    parse_sampling,
    stream_include_usage,
)
from llm_server.api.shared.tool_fields import message_extras, parse_template_kwargs, parse_tools
from llm_server.decoding import MAX_TOP_LOGPROBS, SamplingParams
from llm_server.generation_config import SamplingDefaults
from llm_server.tools.spec import ToolRequest

ROLES = ("system", "user", "assistant", "developer", "tool")
IMAGE_ROLES = ("user", "tool")  # the messages an image_url part may be in


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    response_format: dict | None
    model: str | None
    n: int = 1  # choices generated from the prompt
    tools: ToolRequest = ToolRequest()
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    thinking_budget: int | None = None  # thinking tokens before </think> is forced (Messages)
    prediction: str | None = None  # OpenAI predicted output: text the answer likely repeats


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]  # text prompts or token-id prompts
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # None: no logprobs; else top-k count 0..20
    model: str | None
    n: int = 1  # choices generated from each prompt


def _content(value: Any, index: int, role: str) -> str | list[dict[str, Any]]:
    """A message's content: one string, or text and image parts in order when it carries an
    image (llm_server/images.py; an adapter's own image parts pass through)."""
    param = f"messages[{index}].content"
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise invalid(param, f"'{param}' must be a string or an array of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url" and role in IMAGE_ROLES:
            parts.append(_image_url_part(part, f"{param}[{j}]"))
        elif is_image_part(part):
            parts.append(part)
        elif kind != "text":
            hint = "'text' parts, and 'image_url' parts in user messages"
            raise invalid(f"{param}[{j}]", f"content part type {kind!r} is not supported; {hint}")
        elif not isinstance(part.get("text"), str):
            raise invalid(f"{param}[{j}].text", "a text part needs a string 'text'")
        else:
            parts.append({"type": "text", "text": part["text"]})
    if not any(is_image_part(p) for p in parts):  # text only: one string, as always
        return "".join(p["text"] for p in parts)
    return parts


def _image_url_part(part: dict, param: str) -> dict[str, Any]:
    """`{"type": "image_url", "image_url": URL or {"url", "detail"}}` as an image part."""
    field = f"{param}.image_url"
    spec = part.get("image_url")
    if isinstance(spec, dict):
        check_detail(spec.get("detail"), f"{field}.detail")
        spec = spec.get("url")
    elif spec is None:
        raise invalid(field, "an image_url part needs 'image_url': {\"url\": a data: URL}")
    return image_part(url_ref(spec, field))


def parse_messages(body: dict) -> tuple[dict[str, Any], ...]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "'messages' is required")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}")
        out.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(m.get("content"), i, role),
                **message_extras(m, i),
            }
        )
    return tuple(out)


def parse_chat(
    body: dict,
    default_max_tokens: int,
    vocab_size: int | None = None,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> ChatRequest:
    messages = parse_messages(body)
    stream = bool(get_field(body, "stream", bool, False))
    logprobs = bool(get_field(body, "logprobs", bool, False))
    top = get_field(body, "top_logprobs", int, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    if top and not logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    max_tokens = max_tokens_field(
        body, default_max_tokens, ("max_completion_tokens", "max_tokens"), 1
    )
    fmt = get_field(body, "response_format", dict)
    if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(
            "response_format.type",
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
        )
    if fmt is not None and fmt.get("type") == "text":
        fmt = None
    return ChatRequest(
        messages=messages,
        params=parse_sampling(body, max_tokens, logprobs, top, vocab_size, defaults),
        stream=stream,
        include_usage=stream_include_usage(body, stream),
        response_format=fmt,
        model=get_field(body, "model", str),
        n=parse_n(body),
        tools=parse_tools(body),
        template_kwargs=parse_template_kwargs(body),
        prediction=parse_prediction(body),
    )


def parse_prediction(body: dict) -> str | None:
    """OpenAI's `prediction`: {"type": "content", "content": a string or text parts}."""
    pred = body.get("prediction")
    if pred is None:
        return None
    why = '\'prediction\' must be {"type": "content", "content": a string or text parts}'
    if (
        not isinstance(pred, dict)
        or pred.get("type") != "content"
        or set(pred) - {"type", "content"}
    ):
        raise invalid("prediction", why)
    content = pred.get("content")
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return "".join(p["text"] for p in content)
    raise invalid("prediction", why)


def _prompts(body: dict, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "'prompt' is required")
    if isinstance(prompt, str):
        items: list = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid(
            "prompt",
            "'prompt' must be a string, an array of strings, token ids, or arrays of token ids",
        )
    out: list[str | tuple[int, ...]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise invalid(
                    f"prompt[{i}]",
                    f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}",
                )
            out.append(tuple(p))
        else:
            raise invalid(f"prompt[{i}]", f"prompt[{i}] must be a string or an array of token ids")
    return tuple(out)


def parse_completion(
    body: dict,
    default_max_tokens: int,
    vocab_size: int,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> CompletionRequest:
    prompts = _prompts(body, vocab_size)
    stream = bool(get_field(body, "stream", bool, False))
    lp = body.get("logprobs")
    if lp is True:
        lp = 1
    elif lp is False:
        lp = None
    if lp is not None and (not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise invalid("logprobs", f"'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}")
    max_tokens = max_tokens_field(body, default_max_tokens, ("max_tokens",), 0)
    echo = bool(get_field(body, "echo", bool, False))
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens", "'max_tokens' must be at least 1 unless 'echo' is true")
    if body.get("prediction") not in (None, ""):
        raise invalid(
            "prediction",
            "predicted outputs ('prediction') are supported on /v1/chat/completions only",
        )
    return CompletionRequest(
        prompts=prompts,
        params=parse_sampling(body, max_tokens, lp is not None, lp or 0, vocab_size, defaults),
        stream=stream,
        include_usage=stream_include_usage(body, stream),
        echo=echo,
        logprobs=lp,
        model=get_field(body, "model", str),
        n=parse_n(body),
    )
