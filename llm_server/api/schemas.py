"""Parse and validate OpenAI request bodies into plain request objects (400 on bad input)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llm_server.api.chat_tools import message_extras, parse_template_kwargs, parse_tools
from llm_server.api.errors import invalid
from llm_server.decoding import MAX_TOP_LOGPROBS, SamplingParams
from llm_server.tools.spec import ToolRequest

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    response_format: dict | None
    model: str | None
    tools: ToolRequest = ToolRequest()
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]  # text prompts or token-id prompts
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # None: no logprobs; else top-k count 0..20
    model: str | None


def _get(body: dict, key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise invalid(key, f"'{key}' must be {_kind_name(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise invalid(key, f"'{key}' must be {_kind_name(kinds)}, got {type(value).__name__}")
    return value


def _kind_name(kinds: type | tuple[type, ...]) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = _get(body, key, (int, float), default)
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise invalid(key, f"'{key}' must be between {lo:g} and {hi:g}, got {value:g}")
    return value


def _max_tokens(body: dict, default: int, keys: tuple[str, ...], minimum: int) -> int:
    for key in keys:
        value = _get(body, key, int)
        if value is not None:
            if value < minimum:
                raise invalid(key, f"'{key}' must be at least {minimum}, got {value}")
            return value
    return default


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", "'stop' must be a string or an array of strings")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise invalid(
            "stop", f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}"
        )
    for s in stop:
        if not s:
            raise invalid("stop", "stop sequences must not be empty")
        if len(s) > MAX_STOP_LENGTH:
            raise invalid("stop", f"stop sequences are at most {MAX_STOP_LENGTH} characters")
    return tuple(stop)


def _sampling(body: dict, max_tokens: int, logprobs: bool, top: int) -> SamplingParams:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}; send separate requests instead")
    seed = _get(body, "seed", int)
    if seed is not None and seed < 0:
        raise invalid("seed", f"'seed' must be 0 or more, got {seed}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1.0,
        seed=seed,
        stop=_stop(body),
        logprobs=logprobs,
        top_logprobs=top,
    )


def _stream_options(body: dict, stream: bool) -> bool:
    opts = _get(body, "stream_options", dict)
    if opts is None:
        return False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return bool(_get(opts, "include_usage", bool, False))


def _content(value: Any, index: int) -> str:
    param = f"messages[{index}].content"
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if not isinstance(value, list):
        raise invalid(param, f"'{param}' must be a string or an array of text parts")
    parts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(
                f"{param}[{j}]", f"content part type {kind!r} is not supported; only 'text' parts"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{param}[{j}].text", "a text part needs a string 'text'")
        parts.append(text)
    return "".join(parts)


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
                "content": _content(m.get("content"), i),
                **message_extras(m, i),
            }
        )
    return tuple(out)


def parse_chat(body: dict, default_max_tokens: int) -> ChatRequest:
    messages = parse_messages(body)
    stream = bool(_get(body, "stream", bool, False))
    logprobs = bool(_get(body, "logprobs", bool, False))
    top = _get(body, "top_logprobs", int, 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}")
    if top and not logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    max_tokens = _max_tokens(body, default_max_tokens, ("max_completion_tokens", "max_tokens"), 1)
    fmt = _get(body, "response_format", dict)
    if fmt is not None and fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(
            "response_format.type",
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
        )
    if fmt is not None and fmt.get("type") == "text":
        fmt = None
    return ChatRequest(
        messages=messages,
        params=_sampling(body, max_tokens, logprobs, top),
        stream=stream,
        include_usage=_stream_options(body, stream),
        response_format=fmt,
        model=_get(body, "model", str),
        tools=parse_tools(body),
        template_kwargs=parse_template_kwargs(body),
    )


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


def parse_completion(body: dict, default_max_tokens: int, vocab_size: int) -> CompletionRequest:
    prompts = _prompts(body, vocab_size)
    stream = bool(_get(body, "stream", bool, False))
    lp = body.get("logprobs")
    if lp is True:
        lp = 1
    elif lp is False:
        lp = None
    if lp is not None and (not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise invalid("logprobs", f"'logprobs' must be an integer between 0 and {MAX_TOP_LOGPROBS}")
    max_tokens = _max_tokens(body, default_max_tokens, ("max_tokens",), 0)
    echo = bool(_get(body, "echo", bool, False))
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens", "'max_tokens' must be at least 1 unless 'echo' is true")
    return CompletionRequest(
        prompts=prompts,
        params=_sampling(body, max_tokens, lp is not None, lp or 0),
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
        logprobs=lp,
        model=_get(body, "model", str),
    )
