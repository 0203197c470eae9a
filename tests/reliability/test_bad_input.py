"""The bad-input catalogue: what clients may send, the status each gets, and that none is a 500.

Decisions this catalogue pins down:
- unknown fields are ignored; a known field of the wrong type is a 400; an OpenAI field the
  server does not implement (`functions`, `audio`, `suffix`, ...) is a 400 naming it, while
  `user`, `metadata`, `store` and `service_tier` are accepted as no-ops;
- a huge `max_tokens` is accepted and capped by the context: generation stops when the
  context is full, with finish_reason "length" (no 400 for asking for more than fits);
- bodies must be UTF-8 JSON objects sent as `application/json` (415 otherwise: this keeps
  browsers from posting to a loopback server cross-site without a CORS preflight);
- control characters are plain text; unpaired surrogate escapes are a 400.
See tests/api/test_errors.py for the per-route error paths; this is the broader list.
"""

from __future__ import annotations

import json

import pytest

from llm_server.settings import DEFAULT_MAX_BODY_BYTES
from tests.reliability.bad_input import (
    CHAT,
    COMP,
    CONTEXT,
    VOCAB,
    Case,
    chat,
    check_openai_case,
    check_still_serves,
    comp,
    user,
)

CASES = [
    # -- the body itself --
    Case("malformed-json", CHAT, b'{"messages": [', 400, None, ("not valid JSON",)),
    Case("json-array-body", COMP, b'["hi"]', 400, None, ("JSON object",)),
    Case("json-scalar-body", COMP, b"42", 400, None, ("JSON object",)),
    Case("empty-body", CHAT, b"", 400, None, ("not valid JSON",)),
    Case(
        "text-plain",
        CHAT,
        json.dumps(chat()).encode(),
        415,
        None,
        ("application/json", "text/plain"),
        "unsupported_media_type",
        {"content-type": "text/plain"},
    ),
    Case(
        "form-urlencoded",
        COMP,
        b"prompt=hi",
        415,
        None,
        ("application/json",),
        "unsupported_media_type",
        {"content-type": "application/x-www-form-urlencoded"},
    ),
    Case(
        "no-content-type",
        CHAT,
        json.dumps(chat()).encode(),
        415,
        None,
        ("Content-Type",),
        headers={},
    ),
    Case(
        "json-with-charset",
        CHAT,
        json.dumps(chat()).encode(),
        200,
        headers={"content-type": "application/json; charset=utf-8"},
        finish="length",
    ),
    Case(
        "body-over-limit",
        CHAT,
        json.dumps(user("a " * (DEFAULT_MAX_BODY_BYTES // 2 + 1))).encode(),
        413,
        None,
        ("limit",),
        "request_too_large",
    ),
    Case(
        "invalid-utf8",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        None,
        ("UTF-8",),
    ),
    Case("encoded-surrogate", COMP, b'{"prompt": "a\xed\xa0\x80b"}', 400, None, ("UTF-8",)),
    Case(
        "lone-surrogate-escape",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        None,
        ("surrogate",),
    ),
    Case(
        "lone-surrogate-tokenize", "/tokenize", b'{"prompt": "\\udc00"}', 400, None, ("surrogate",)
    ),
    Case(
        "surrogate-pair-ok",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}',
        200,
        finish="length",
    ),
    Case(
        "deep-nesting",
        CHAT,
        b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        None,
        ("deeply",),
    ),
    Case(
        "nan-temperature",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
        ("temperature", "between 0 and 2"),
    ),
    Case(
        "infinite-top-p",
        CHAT,
        b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}',
        400,
        "top_p",
        ("top_p", "between 0 and 1"),
    ),
    # -- fields: unknown ignored, wrong types refused --
    Case(
        "unknown-fields-ignored",
        CHAT,
        chat(frobnicate={"x": [1]}, user_id="u1", logit_bias_x=3),
        200,
        finish="length",
    ),
    Case("stream-as-string", CHAT, chat(stream="yes"), 400, "stream", ("stream", "boolean")),
    Case(
        "max-tokens-as-string",
        CHAT,
        chat(max_tokens="10"),
        400,
        "max_tokens",
        ("max_tokens", "integer"),
    ),
    Case(
        "max-tokens-as-bool",
        COMP,
        comp(max_tokens=True),
        400,
        "max_tokens",
        ("max_tokens", "boolean"),
    ),
    Case(
        "max-tokens-as-float",
        COMP,
        comp(max_tokens=2.5),
        400,
        "max_tokens",
        ("max_tokens", "integer"),
    ),
    Case("model-as-number", CHAT, chat(model=7), 400, "model", ("model", "string")),
    Case(
        "logprobs-as-string", CHAT, chat(logprobs="yes"), 400, "logprobs", ("logprobs", "boolean")
    ),
    Case("seed-negative", CHAT, chat(seed=-5), 400, "seed", ("seed", "0 or more")),
    Case("seed-huge", CHAT, chat(seed=2**80, temperature=0.7), 200, finish="length"),
    # -- messages --
    Case("missing-messages", CHAT, {"max_tokens": 2}, 400, "messages", ("messages", "required")),
    Case("messages-empty-list", CHAT, chat(messages=[]), 400, "messages", ("non-empty",)),
    Case("messages-a-string", CHAT, chat(messages="hi"), 400, "messages", ("array",)),
    Case("message-not-object", CHAT, chat(messages=["hi"]), 400, "messages[0]", ("object",)),
    Case(
        "message-without-role",
        CHAT,
        chat(messages=[{"content": "x"}]),
        400,
        "messages[0].role",
        ("role", "user"),
    ),
    Case(
        "all-contents-empty",
        CHAT,
        chat(messages=[{"role": "system", "content": ""}, {"role": "user", "content": None}]),
        400,
        "messages",
        ("empty",),
    ),
    Case(
        "content-a-number", CHAT, user(5), 400, "messages[0].content", ("string", "content parts")
    ),
    Case(
        "content-part-audio",
        CHAT,
        user([{"type": "input_audio", "input_audio": {"data": "AAAA"}}]),
        400,
        "messages[0].content[0]",
        ("input_audio", "text"),
    ),
    Case(
        "content-part-no-type",
        CHAT,
        user([{"text": "hi"}]),
        400,
        "messages[0].content[0]",
        ("None", "text"),
    ),
    Case(
        "content-part-nested",
        CHAT,
        user([{"type": "text", "text": [{"type": "text", "text": "x"}]}]),
        400,
        "messages[0].content[0].text",
        ("text",),
    ),
    Case(
        "content-part-a-string", CHAT, user(["hi"]), 400, "messages[0].content[0]", ("str", "text")
    ),
    Case(
        "text-parts-ok",
        CHAT,
        user([{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]),
        200,
        finish="length",
    ),
    Case(
        "control-characters", CHAT, user("a\x00b\x07c\x1b[2J\x7f\u202e\ufeff"), 200, finish="length"
    ),
    Case("long-single-token-fits", CHAT, user("a" * 600), 200, finish="length"),
    Case(
        "long-single-token-too-long",
        CHAT,
        user("x" * 1_000_000),
        400,
        "messages",
        ("tokens", str(CONTEXT), "shorten"),
        "context_length_exceeded",
    ),
    Case(
        "chat-over-context",
        CHAT,
        user("one two three " * 600),
        400,
        "messages",
        ("context holds 1024", "shorten"),
        "context_length_exceeded",
    ),
    # -- prompts (completions) --
    Case("missing-prompt", COMP, {"max_tokens": 2}, 400, "prompt", ("prompt", "required")),
    Case("empty-prompt", COMP, comp(prompt=""), 400, "prompt", ("empty",)),
    Case("empty-id-list", COMP, comp(prompt=[]), 400, "prompt", ("token ids",)),
    Case("empty-nested-id-list", COMP, comp(prompt=[[]]), 400, "prompt", ("empty",)),
    Case(
        "prompt-a-dict", COMP, comp(prompt={"text": "hi"}), 400, "prompt", ("string", "token ids")
    ),
    Case("prompt-mixed-garbage", COMP, comp(prompt=["a", 5.5]), 400, "prompt[1]", ("token ids",)),
    Case(
        "token-id-at-vocab",
        COMP,
        comp(prompt=[1, VOCAB]),
        400,
        "prompt[0]",
        (str(VOCAB), "vocabulary"),
    ),
    Case("token-id-negative", COMP, comp(prompt=[-1]), 400, "prompt[0]", ("-1", "vocabulary")),
    Case("token-id-2^70", COMP, comp(prompt=[[5], [2**70]]), 400, "prompt[1]", ("vocabulary",)),
    Case("token-id-bool", COMP, comp(prompt=[True, 5]), 400, "prompt[0]", ("token ids",)),
    Case(
        "detokenize-out-of-vocab",
        "/detokenize",
        {"tokens": [VOCAB + 1]},
        400,
        "tokens",
        ("vocabulary",),
    ),
    Case(
        "prompt-over-context",
        COMP,
        comp(prompt=[5] * (CONTEXT + 1)),
        400,
        "prompt",
        ("1025", "1024"),
        "context_length_exceeded",
    ),
    Case(
        "scoring-over-context",
        COMP,
        comp(prompt=[5] * (CONTEXT + 1), max_tokens=0, echo=True, logprobs=1),
        400,
        "prompt",
        ("1025", "1024"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(http, case: Case):
    check_openai_case(http, case)


def test_catalogue_leaves_the_server_healthy(http):
    """After every case above (run first in this module) the server still serves."""
    check_still_serves(http)
