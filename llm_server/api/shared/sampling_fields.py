"""The sampling fields shared by chat and completions bodies: type checks, ranges, and the
SamplingParams they make (400 naming a bad field)."""

from __future__ import annotations

import math
from typing import Any

from llm_server.api.shared.errors import invalid
from llm_server.decoding import SamplingParams
from llm_server.generation_config import SamplingDefaults

OPENAI_DEFAULTS = SamplingDefaults()

MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256


def get_field(body: dict, key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    """`body[key]` checked to be of `kinds` (400 naming it); `default` when absent or null."""
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
    value = get_field(body, key, (int, float), default)
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise invalid(key, f"'{key}' must be between {lo:g} and {hi:g}, got {value:g}")
    return value


def max_tokens_field(body: dict, default: int, keys: tuple[str, ...], minimum: int) -> int:
    """The first of `keys` the body sends (at least `minimum`), else `default`."""
    for key in keys:
        value = get_field(body, key, int)
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
    "web_search_options": "web search is not supported by a local model",
    "suffix": "'suffix' (insertion) is not supported; send the text before it as 'prompt'",
}
# Accepted and ignored, as they change nothing a local server does (README "Request fields"):
# user, metadata, store, service_tier, prompt_cache_key, safety_identifier.


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
    n = get_field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise invalid("n", f"'n' must be between 1 and {MAX_N}, got {n}")
    best_of = get_field(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise invalid(
            "best_of", f"'best_of' is not supported (only equal to 'n', {n}); got {best_of}"
        )
    return n


def _top_k(body: dict, default: int) -> int:
    value = get_field(body, "top_k", int, default)
    if value < -1:
        raise invalid("top_k", f"'top_k' must be 0 or -1 (off) or a positive integer, got {value}")
    return max(value, 0)


def _repetition_penalty(body: dict) -> float:
    value = float(get_field(body, "repetition_penalty", (int, float), 1.0))
    if not math.isfinite(value) or not 0.0 < value <= MAX_REPETITION_PENALTY:
        raise invalid(
            "repetition_penalty",
            f"'repetition_penalty' must be above 0 and at most {MAX_REPETITION_PENALTY:g} "
            f"(1 is off), got {value:g}",
        )
    return value


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    bias = get_field(body, "logit_bias", dict)
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


def parse_sampling(
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
    seed = get_field(body, "seed", int)
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


def stream_include_usage(body: dict, stream: bool) -> bool:
    """`stream_options.include_usage` (a 400 when sent without streaming)."""
    opts = get_field(body, "stream_options", dict)
    if opts is None:
        return False
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return bool(get_field(opts, "include_usage", bool, False))
