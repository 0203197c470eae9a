"""Is a replayed response the logged one? Compares what a user reads, reports where it first differs.

Chat: each choice's message content (character index), finish_reason, logprob tokens (token
index). Responses / Messages: the kinds of the output items / content blocks, each one's text
(calls as name and arguments), then status / stop_reason. Embeddings: each vector within
EMBEDDING_TOLERANCE (float or base64), by index. Completions: each choice's text (character index), logprob tokens and values (token
index; values within LOGPROB_TOLERANCE), finish_reason. Errors: status and error code. Other
endpoints: the whole body, less the fields that change on every call.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import dataclass

LOGPROB_TOLERANCE = 1e-3  # nats; batched and serial float32 scoring agree far closer than this
EMBEDDING_TOLERANCE = 1e-4  # per component; batched and alone agree within 1e-5 (float32)
VOLATILE = {"id", "created", "system_fingerprint"}


@dataclass(frozen=True)
class Difference:
    """Where a replayed response first departs from the logged one."""

    field: str  # e.g. "choices[0].message.content", "status"
    position: int | None = None  # first differing index in `unit`s; None for whole values
    unit: str | None = None  # "char" | "token" | None
    logged: object = None  # short excerpts around the position
    replayed: object = None


def is_deterministic(endpoint: str, request: dict) -> bool:
    """True when the request must give the same output every time (temperature 0, scoring)."""
    if not endpoint.startswith("/v1/") or endpoint.endswith("/embeddings"):
        return True  # tokenizer routes, embeddings and the like
    max_tokens = request.get("max_tokens", request.get("max_completion_tokens"))
    scoring = bool(request.get("echo")) and request.get("logprobs") is not None
    legacy = endpoint.endswith("/completions") and not endpoint.endswith("/chat/completions")
    if legacy and (scoring or max_tokens == 0):
        return True  # scoring is greedy; max_tokens 0 only echoes
    temperature = request.get("temperature")
    return isinstance(temperature, int | float) and temperature == 0


def compare(
    endpoint: str,
    logged_status: int,
    logged: dict | None,
    status: int,
    replayed: dict | None,
) -> Difference | None:
    """None when the replay matches the log, else the first difference."""
    if status != logged_status:
        return Difference("status", logged=logged_status, replayed=status)
    if logged is None or replayed is None:
        return None if logged == replayed else Difference("body", logged=logged, replayed=replayed)
    if "error" in logged or "error" in replayed:
        return _compare_error(logged, replayed)
    if endpoint.endswith("/chat/completions"):
        return _compare_choices(logged, replayed, _chat_choice)
    if endpoint.endswith("/responses"):
        return _compare_parts(
            logged, replayed, "output", ("status",), lambda item: _item_text(item, "content")
        )
    if endpoint.endswith("/messages"):
        return _compare_parts(
            logged, replayed, "content", ("stop_reason", "stop_sequence"), _block_text
        )
    if endpoint.endswith("/completions"):
        return _compare_choices(logged, replayed, _completion_choice)
    if endpoint.endswith("/embeddings"):
        return _compare_embeddings(logged, replayed)
    a = {k: v for k, v in logged.items() if k not in VOLATILE}
    b = {k: v for k, v in replayed.items() if k not in VOLATILE}
    return None if a == b else Difference("body", logged=a, replayed=b)


def _compare_parts(
    logged: dict, replayed: dict, key: str, fields: tuple[str, ...], text
) -> Difference | None:
    """Responses `output` items / Messages `content` blocks: kind, then text (by character),
    then the `fields` of the body (status, stop_reason)."""
    a, b = logged.get(key) or [], replayed.get(key) or []
    kinds_a, kinds_b = [p.get("type") for p in a], [p.get("type") for p in b]
    if kinds_a != kinds_b:
        return Difference(key, logged=kinds_a, replayed=kinds_b)
    for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
        diff = text_difference(f"{key}[{i}]", text(pa), text(pb))
        if diff is not None:
            return diff
    for f in fields:
        diff = _same(f, logged.get(f), replayed.get(f))
        if diff is not None:
            return diff
    return None


def _vector(embedding: list | str) -> list[float]:
    if isinstance(embedding, str):  # base64 of little-endian float32
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    return [float(x) for x in embedding]


def _compare_embeddings(logged: dict, replayed: dict) -> Difference | None:
    a, b = logged.get("data") or [], replayed.get("data") or []
    if len(a) != len(b):
        return Difference("data", logged=len(a), replayed=len(b))
    for i, (ea, eb) in enumerate(zip(a, b, strict=True)):
        va, vb = _vector(ea.get("embedding") or []), _vector(eb.get("embedding") or [])
        if len(va) != len(vb):
            return Difference(f"data[{i}].embedding", logged=len(va), replayed=len(vb))
        for j, (x, y) in enumerate(zip(va, vb, strict=True)):
            if abs(x - y) > EMBEDDING_TOLERANCE:
                return Difference(f"data[{i}].embedding", j, "component", x, y)
    return _same("usage", logged.get("usage"), replayed.get("usage"))


def _item_text(item: dict, key: str) -> str:
    """What a user reads of one Responses output item."""
    if item.get("type") == "function_call":
        return f"{item.get('name')}({item.get('arguments')})"
    return "".join(p.get("text") or "" for p in item.get(key) or [] if isinstance(p, dict))


def _block_text(block: dict) -> str:
    """What a user reads of one Messages content block."""
    if block.get("type") == "tool_use":
        return f"{block.get('name')}({json.dumps(block.get('input'), sort_keys=True)})"
    return block.get("text") or block.get("thinking") or ""


def _compare_error(logged: dict, replayed: dict) -> Difference | None:
    a, b = logged.get("error"), replayed.get("error")
    code_a = (a.get("code") or a.get("type")) if isinstance(a, dict) else a
    code_b = (b.get("code") or b.get("type")) if isinstance(b, dict) else b
    return None if code_a == code_b else Difference("error", logged=code_a, replayed=code_b)


def _compare_choices(logged: dict, replayed: dict, one) -> Difference | None:
    a, b = logged.get("choices") or [], replayed.get("choices") or []
    if len(a) != len(b):
        return Difference("choices", logged=len(a), replayed=len(b))
    for i, (ca, cb) in enumerate(zip(a, b, strict=True)):
        diff = one(f"choices[{i}]", ca, cb)
        if diff is not None:
            return diff
    return None


def _chat_choice(where: str, a: dict, b: dict) -> Difference | None:
    text_a = (a.get("message") or {}).get("content") or ""
    text_b = (b.get("message") or {}).get("content") or ""
    diff = text_difference(f"{where}.message.content", text_a, text_b)
    if diff is None:
        lp_a = [t.get("token") for t in ((a.get("logprobs") or {}).get("content") or [])]
        lp_b = [t.get("token") for t in ((b.get("logprobs") or {}).get("content") or [])]
        diff = token_difference(f"{where}.logprobs.content", lp_a, lp_b)
    return diff or _same(f"{where}.finish_reason", a.get("finish_reason"), b.get("finish_reason"))


def _completion_choice(where: str, a: dict, b: dict) -> Difference | None:
    diff = text_difference(f"{where}.text", a.get("text") or "", b.get("text") or "")
    lp_a, lp_b = a.get("logprobs") or {}, b.get("logprobs") or {}
    if diff is None:
        diff = token_difference(
            f"{where}.logprobs.tokens", lp_a.get("tokens") or [], lp_b.get("tokens") or []
        )
    if diff is None:
        diff = logprob_difference(
            f"{where}.logprobs.token_logprobs",
            lp_a.get("token_logprobs") or [],
            lp_b.get("token_logprobs") or [],
        )
    return diff or _same(f"{where}.finish_reason", a.get("finish_reason"), b.get("finish_reason"))


def _same(where: str, a: object, b: object) -> Difference | None:
    return None if a == b else Difference(where, logged=a, replayed=b)


def first_difference(a: list | str, b: list | str) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def text_difference(where: str, a: str, b: str) -> Difference | None:
    pos = first_difference(a, b)
    if pos is None:
        return None
    return Difference(where, pos, "char", a[pos : pos + 40], b[pos : pos + 40])


def token_difference(where: str, a: list, b: list) -> Difference | None:
    pos = first_difference(a, b)
    if pos is None:
        return None
    return Difference(where, pos, "token", a[pos : pos + 5], b[pos : pos + 5])


def logprob_difference(where: str, a: list, b: list) -> Difference | None:
    def close(x: float | None, y: float | None) -> bool:
        if x is None or y is None:
            return x is y
        return math.isclose(x, y, rel_tol=0.0, abs_tol=LOGPROB_TOLERANCE)

    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if not close(x, y):
            return Difference(where, i, "token", x, y)
    if len(a) != len(b):
        return Difference(where, min(len(a), len(b)), "token")
    return None
