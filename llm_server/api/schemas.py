"""Parse and validate OpenAI request bodies into plain request objects (400 on bad input)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from llm_server.api.chat_tools import message_extras, parse_template_kwargs, parse_tools
from llm_server.api.errors import invalid
from llm_server.decoding import MAX_TOP_LOGPROBS, SamplingParams
from llm_server.generation_config import SamplingDefaults
from llm_server.tools.spec import ToolRequest

OPENAI_DEFAULTS = SamplingDefaults()

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


# -- the sampling fields, shared by chat and completions -----------------------------------

MAX_N = 8  # choices per request (each takes a row or a queue slot)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
LOGIT_BIAS_RANGE = 100.0
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty: [-2, 2] as OpenAI documents
MAX_REPETITION_PENALTY = 2.0  # (0, 2] as vLLM takes it
TEMPERATURE_RANGE = (0.0, 2.0)
PROBABILITY_RANGE = (0.0, 1.0)  # top_p and min_p

# Fields a client may rely on that this server does not implement: a 400 naming the field
# (with what to do instead) rather than silently ignoring them. A null value is accepted.
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated 'functions' is not supported; send 'tools' instead",
    "function_call": "the deprecated 'function_call' is not supported; send 'tool_choice'",
    "audio": "audio output is not supported; this server generates text",
    "prediction": "predicted outputs ('prediction') are supported on /v1/chat/completions only",
    "web_search_options": "web search is not supported by a local model",
    "suffix": "'suffix' (insertion) is not supported; send the text before it as 'prompt'",
}
# Accepted and ignored: they change nothing a local server does (see README "Request fields").
NO_OP_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)


def refuse_unsupported(body: dict) -> None:
    """400 for a field this server does not implement (see UNSUPPORTED_FIELDS)."""
    for key, why in UNSUPPORTED_FIELDS.items():
        value = body.get(key)
        if value is not None and value != "":
            raise invalid(key, why)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("modalities", "only 'modalities': ['text'] is supported")
    verbosity = body.get("verbosity")
    if verbosity is not None and verbosity != "medium":
        raise invalid("verbosity", "'verbosity' is not supported; only 'medium' (the default)")


def parse_n(body: dict) -> int:
    """How many choices to generate from the prompt (1..MAX_N); best_of must be n or absent."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"'n' must be between 1 and {MAX_N}, got {n}")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise invalid(
            "best_of", f"'best_of' is not supported (only equal to 'n', {n}); got {best_of}"
        )
    return n


def _top_k(body: dict, default: int) -> int:
    value = _get(body, "top_k", int, default)
    if value < -1:
        raise invalid("top_k", f"'top_k' must be 0 or -1 (off) or a positive integer, got {value}")
    return max(value, 0)


def _repetition_penalty(body: dict) -> float:
    value = float(_get(body, "repetition_penalty", (int, float), 1.0))
    if not math.isfinite(value) or not 0.0 < value <= MAX_REPETITION_PENALTY:
        raise invalid(
            "repetition_penalty",
            f"'repetition_penalty' must be above 0 and at most {MAX_REPETITION_PENALTY:g} "
            f"(1 is off), got {value:g}",
        )
    return value


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    bias = _get(body, "logit_bias", dict)
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid(
            "logit_bias", f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids, got {key!r}")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise invalid(
                "logit_bias",
                f"'logit_bias' token id {token} is outside the vocabulary 0..{vocab_size - 1}",
            )
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or abs(value) > LOGIT_BIAS_RANGE:
            raise invalid(
                "logit_bias",
                f"'logit_bias' values must be numbers between {-LOGIT_BIAS_RANGE:g} and "
                f"{LOGIT_BIAS_RANGE:g}, got {value!r} "
                f"for token {key}",
            )
        out[token] = float(value)
    return tuple(out.items())


def _sampling(
    body: dict,
    max_tokens: int,
    logprobs: bool,
    top: int,
    vocab_size: int | None = None,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> SamplingParams:
    """The sampling fields of a chat or completions body (400 naming a bad one); a field the
    body omits (or sends as null) takes `defaults`'s value (the checkpoint's generation config)."""
    refuse_unsupported(body)
    seed = _get(body, "seed", int)
    if seed is not None and seed < 0:
        raise invalid("seed", f"'seed' must be 0 or more, got {seed}")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", defaults.temperature, *TEMPERATURE_RANGE),
        top_p=_number(body, "top_p", defaults.top_p, *PROBABILITY_RANGE) or 1.0,
        seed=seed,
        stop=_stop(body),
        logprobs=logprobs,
        top_logprobs=top,
        top_k=_top_k(body, defaults.top_k),
        min_p=_number(body, "min_p", defaults.min_p, *PROBABILITY_RANGE),
        repetition_penalty=_repetition_penalty(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, -PENALTY_RANGE, PENALTY_RANGE),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -PENALTY_RANGE, PENALTY_RANGE),
        logit_bias=_logit_bias(body, vocab_size),
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


def parse_chat(
    body: dict,
    default_max_tokens: int,
    vocab_size: int | None = None,
    defaults: SamplingDefaults = OPENAI_DEFAULTS,
) -> ChatRequest:
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
    prediction = parse_prediction(body)
    body = {k: v for k, v in body.items() if k != "prediction"}  # taken: not unsupported here
    return ChatRequest(
        messages=messages,
        params=_sampling(body, max_tokens, logprobs, top, vocab_size, defaults),
        stream=stream,
        include_usage=_stream_options(body, stream),
        response_format=fmt,
        model=_get(body, "model", str),
        n=parse_n(body),
        tools=parse_tools(body),
        template_kwargs=parse_template_kwargs(body),
        prediction=prediction,
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
        params=_sampling(body, max_tokens, lp is not None, lp or 0, vocab_size, defaults),
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
        logprobs=lp,
        model=_get(body, "model", str),
        n=parse_n(body),
    )
