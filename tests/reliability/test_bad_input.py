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
from dataclasses import dataclass, field

import pytest

from tests.api.helpers import assert_openai_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
EMB = "/v1/embeddings"
VOCAB = 384  # the tiny checkpoint's vocabulary (tests/conftest.py: tiny_model_path)
CONTEXT = 1024
MSG = [{"role": "user", "content": "hi"}]
JSON_CT = {"content-type": "application/json"}


def chat(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, "temperature": 0, **kw}


def comp(**kw) -> dict:
    return {"prompt": "hi", "max_tokens": 2, "temperature": 0, **kw}


def user(content) -> dict:
    return chat(messages=[{"role": "user", "content": content}])


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict | bytes
    status: int
    param: str | None = None
    words: tuple[str, ...] = ()  # the message must name what to fix
    code: str | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_CT))
    finish: str | None = None  # for 200s: the finish_reason expected


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
        json.dumps(user("a " * (2 << 20))).encode(),
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
    Case("content-a-number", CHAT, user(5), 400, "messages[0].content", ("string", "text parts")),
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
    # -- max_tokens --
    Case(
        "max-tokens-negative",
        CHAT,
        chat(max_tokens=-3),
        400,
        "max_tokens",
        ("max_tokens", "at least 1"),
    ),
    Case("max-tokens-zero-chat", CHAT, chat(max_tokens=0), 400, "max_tokens", ("at least 1",)),
    Case("max-tokens-zero-echo-ok", COMP, comp(max_tokens=0, echo=True), 200, finish="length"),
    Case("max-tokens-huge", COMP, comp(prompt=[5] * 1000, max_tokens=10**30), 200, finish="length"),
    Case(
        "max-tokens-over-room", COMP, comp(prompt=[7] * 1020, max_tokens=100), 200, finish="length"
    ),
    # -- sampling ranges --
    Case(
        "temperature-negative",
        CHAT,
        chat(temperature=-0.1),
        400,
        "temperature",
        ("between 0 and 2",),
    ),
    Case(
        "temperature-too-high",
        COMP,
        comp(temperature=2.5),
        400,
        "temperature",
        ("between 0 and 2",),
    ),
    Case("top-p-negative", CHAT, chat(top_p=-1), 400, "top_p", ("between 0 and 1",)),
    Case("top-p-over-one", COMP, comp(top_p=1.01), 400, "top_p", ("between 0 and 1",)),
    Case(
        "top-logprobs-negative",
        CHAT,
        chat(logprobs=True, top_logprobs=-1),
        400,
        "top_logprobs",
        ("between 0 and 20",),
    ),
    Case(
        "stop-too-many",
        COMP,
        comp(stop=["a", "b", "c", "d", "e", "f"]),
        400,
        "stop",
        ("at most 4", "6"),
    ),
    Case("stop-too-long", CHAT, chat(stop="x" * 300), 400, "stop", ("at most 256",)),
    Case("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop", ("empty",)),
    Case("stop-an-object", CHAT, chat(stop={"a": 1}), 400, "stop", ("string",)),
    # -- the sampling set and n --
    Case("n-two", CHAT, chat(n=2), 200, finish="length"),
    Case("n-zero", COMP, comp(n=0), 400, "n", ("between 1 and 8", "0")),
    Case("n-hundred", CHAT, chat(n=100), 400, "n", ("between 1 and 8", "100")),
    Case("n-as-float", CHAT, chat(n=2.0), 400, "n", ("integer",)),
    Case("n-over-capacity", COMP, comp(prompt=["a", "b", "c"], n=8), 400, "n", ("24", "18")),
    Case("top-k-minus-one-is-off", CHAT, chat(top_k=-1, temperature=1), 200, finish="length"),
    Case("top-k-minus-two", COMP, comp(top_k=-2), 400, "top_k", ("top_k", "-2")),
    Case("top-k-float", CHAT, chat(top_k=1.5), 400, "top_k", ("integer",)),
    Case("min-p-negative", CHAT, chat(min_p=-0.1), 400, "min_p", ("between 0 and 1",)),
    Case("min-p-over-one", COMP, comp(min_p=1.1), 400, "min_p", ("between 0 and 1",)),
    Case(
        "repetition-penalty-zero",
        CHAT,
        chat(repetition_penalty=0),
        400,
        "repetition_penalty",
        ("above 0", "at most 2"),
    ),
    Case(
        "repetition-penalty-big",
        COMP,
        comp(repetition_penalty=2.5),
        400,
        "repetition_penalty",
        ("at most 2",),
    ),
    Case(
        "presence-penalty-low",
        CHAT,
        chat(presence_penalty=-2.01),
        400,
        "presence_penalty",
        ("between -2 and 2",),
    ),
    Case(
        "frequency-penalty-high",
        COMP,
        comp(frequency_penalty=3),
        400,
        "frequency_penalty",
        ("between -2 and 2",),
    ),
    Case(
        "frequency-penalty-string",
        CHAT,
        chat(frequency_penalty="high"),
        400,
        "frequency_penalty",
        ("number",),
    ),
    Case("logit-bias-list", CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias", ("object",)),
    Case("logit-bias-word-key", CHAT, chat(logit_bias={"hi": 5}), 400, "logit_bias", ("'hi'",)),
    Case("logit-bias-negative-key", COMP, comp(logit_bias={"-1": 5}), 400, "logit_bias", ("-1",)),
    Case(
        "logit-bias-out-of-vocab",
        CHAT,
        chat(logit_bias={str(VOCAB): 5}),
        400,
        "logit_bias",
        (str(VOCAB), "vocabulary"),
    ),
    Case(
        "logit-bias-value-range",
        COMP,
        comp(logit_bias={"5": 101}),
        400,
        "logit_bias",
        ("between -100 and 100", "101"),
    ),
    Case(
        "logit-bias-value-string",
        CHAT,
        chat(logit_bias={"5": "ban"}),
        400,
        "logit_bias",
        ("between -100 and 100",),
    ),
    Case(
        "logit-bias-too-many",
        CHAT,
        chat(logit_bias={str(i): 1 for i in range(301)}),
        400,
        "logit_bias",
        ("at most 300", "301"),
    ),
    Case("logit-bias-ok", COMP, comp(logit_bias={"5": -100, "6": 2.5}), 200, finish="length"),
    Case("best-of-over-n", COMP, comp(best_of=2), 400, "best_of", ("best_of",)),
    Case("best-of-equal-n-ok", COMP, comp(best_of=2, n=2), 200, finish="length"),
    Case("suffix-refused", COMP, comp(suffix="end"), 400, "suffix", ("suffix",)),
    Case("functions-refused", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", ("tools",)),
    Case(
        "function-call-refused",
        CHAT,
        chat(function_call="auto"),
        400,
        "function_call",
        ("tool_choice",),
    ),
    Case("audio-refused", CHAT, chat(audio={"voice": "x"}), 400, "audio", ("audio",)),
    Case("modalities-audio", CHAT, chat(modalities=["text", "audio"]), 400, "modalities", ()),
    Case("modalities-text-ok", CHAT, chat(modalities=["text"]), 200, finish="length"),
    Case("prediction-not-object", CHAT, chat(prediction="x"), 400, "prediction", ("content",)),
    Case(
        "prediction-wrong-type",
        CHAT,
        chat(prediction={"type": "text", "content": "x"}),
        400,
        "prediction",
        ("content",),
    ),
    Case(
        "prediction-bad-parts",
        CHAT,
        chat(prediction={"type": "content", "content": [{"type": "image_url"}]}),
        400,
        "prediction",
        ("text parts",),
    ),
    Case(
        "prediction-ok",
        CHAT,
        chat(prediction={"type": "content", "content": [{"type": "text", "text": "x"}]}),
        200,
        finish="length",
    ),
    Case(
        "prediction-on-completions",
        COMP,
        comp(prediction={"type": "content", "content": "x"}),
        400,
        "prediction",
        ("chat/completions",),
    ),
    Case("verbosity-low", CHAT, chat(verbosity="low"), 400, "verbosity", ("verbosity",)),
    Case(
        "no-op-fields-ok",
        CHAT,
        chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto"),
        200,
        finish="length",
    ),
    # -- model and response_format --
    Case(
        "unknown-model",
        CHAT,
        chat(model="gpt-5-turbo"),
        404,
        "model",
        ("gpt-5-turbo", "does not exist", "serves"),
        "model_not_found",
    ),
    Case(
        "unknown-model-tokenize",
        "/tokenize",
        {"prompt": "hi", "model": "other"},
        404,
        "model",
        ("other",),
    ),
    Case(
        "format-unknown-type",
        CHAT,
        chat(response_format={"type": "yaml"}),
        400,
        "response_format.type",
        ("json_schema",),
    ),
    Case(
        "format-not-object", CHAT, chat(response_format="json"), 400, "response_format", ("object",)
    ),
    Case(
        "schema-missing",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        400,
        "response_format",
        ("json_schema", "schema"),
    ),
    Case(
        "schema-a-list",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        400,
        "response_format",
        ("JSON schema",),
    ),
    Case(
        "schema-bad-type",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "wizard"}},
            }
        ),
        400,
        "response_format",
        ("wizard",),
    ),
    Case(
        "schema-a-string",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": "not a schema"},
            }
        ),
        400,
        "response_format",
        ("schema",),
    ),
]

# -- /v1/embeddings (tests/api/test_embeddings.py has the route's full list) --
CASES += [
    Case("embed-no-input", EMB, {}, 400, "input", ("'input' is required",)),
    Case("embed-empty-string", EMB, {"input": ["a", ""]}, 400, "input[1]", ("empty string",)),
    Case("embed-id-outside-vocab", EMB, {"input": [1, VOCAB]}, 400, "input", ("vocabulary",)),
    Case("embed-too-long", EMB, {"input": [[1] * (CONTEXT + 1)]}, 400, "input[0]", ("1024",)),
    Case("embed-bad-format", EMB, {"input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
    Case("embed-dimensions-zero", EMB, {"input": "a", "dimensions": 0}, 400, "dimensions"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(http, case: Case):
    kwargs = {"headers": case.headers}
    kwargs["content"] = (
        case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    )
    resp = http.post(case.path, **kwargs)
    assert resp.status_code != 500, resp.text
    assert "Traceback" not in resp.text and "/work/" not in resp.text and ".py" not in resp.text
    if case.status == 200:
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        if case.finish is not None:
            assert choice["finish_reason"] == case.finish, choice
        return
    err = assert_openai_error(resp, case.status, case.param)
    for word in case.words:
        assert word in err["message"], (word, err["message"])
    if case.code is not None:
        assert err["code"] == case.code
    expected_type = {404: "not_found_error"}.get(case.status, "invalid_request_error")
    assert err["type"] == expected_type


def test_catalogue_leaves_the_server_healthy(http):
    """After every case above (run first in this module) the server still serves."""
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["rows_busy"] == 0 and body["queue_length"] == 0
    resp = http.post(CHAT, json=chat())
    assert resp.status_code == 200


# -- the agent APIs: each answers bad input in its own error format -------------------------

RESP = "/v1/responses"
MESS = "/v1/messages"
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


def mess(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, "temperature": 0, **kw}


AGENT_CASES = [
    Case("responses-unknown-item-type", RESP, {"input": [{"type": "web_search_call"}]}, 400,
         "input[0].type", ("web_search_call",)),
    Case("responses-image-part", RESP, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0].type"),
    Case("responses-output-without-call", RESP, {"input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400,
         "input[0].call_id", ("call_9",)),
    Case("responses-call-arguments-not-json", RESP, {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400,
         "input[0].arguments"),
    Case("responses-unknown-previous-id", RESP, {"input": "hi", "previous_response_id": "resp_x"},
         404, "previous_response_id", ("resp_x",), "not_found"),
    Case("responses-no-input", RESP, {"instructions": "x"}, 400, "input"),
    Case("responses-builtin-tool", RESP, {"input": "hi", "tools": [{"type": "web_search"}]}, 400,
         "tools[0].type"),
    Case("responses-bad-max-output", RESP, {"input": "hi", "max_output_tokens": 0}, 400,
         "max_output_tokens"),
    Case("responses-background", RESP, {"input": "hi", "background": True}, 400, "background"),
    Case("responses-bad-format", RESP, {"input": "hi", "text": {"format": {"type": "xml"}}}, 400,
         "text.format.type"),
    Case("messages-no-max-tokens", MESS, {"messages": MSG}, 400, None, ("max_tokens",)),
    Case("messages-tool-result-without-use", MESS, mess(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]), 400, None,
         ("toolu_9",)),
    Case("messages-tool-result-for-older-use", MESS, mess(messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]),
         400, None, ("toolu_1",)),
    Case("messages-image-block", MESS, mess(messages=[{"role": "user", "content": [
        {"type": "image", "source": {}}]}]), 400, None, ("image",)),
    Case("messages-bad-role", MESS, mess(messages=[{"role": "system", "content": "x"}]), 400,
         None, ("role",)),
    Case("messages-prefill", MESS, mess(messages=[*MSG, {"role": "assistant", "content": "a"}]),
         400, None, ("prefill",)),
    Case("messages-temperature-over-1", MESS, mess(temperature=1.5), 400, None, ("temperature",)),
    Case("messages-server-tool", MESS, mess(tools=[{"type": "web_search_20250305",
         "name": "w"}]), 400, None, ("web_search_20250305",)),
    Case("messages-thinking-on-a-plain-model", MESS, mess(thinking={"type": "enabled",
         "budget_tokens": 2048}), 400, None, ("does not think",)),
    Case("messages-wrong-model", MESS, mess(model="claude-x"), 404, None, ("claude-x",)),
    Case("messages-not-json", MESS, b"{", 400, None, ("not valid JSON",)),
    Case("messages-tool-choice-a-string", MESS, mess(tool_choice="auto"), 400, None,
         ("tool_choice",)),
    Case("messages-tool-choice-unknown-tool", MESS, mess(tools=[{"name": "f", "input_schema":
         {"type": "object"}}], tool_choice={"type": "tool", "name": "g"}), 400, None, ("'g'",)),
    Case("messages-system-image", MESS, mess(system=[{"type": "image"}]), 400, None, ("image",)),
    Case("messages-budget-not-below-max", MESS, mess(thinking={"type": "enabled",
         "budget_tokens": 2}), 400, None, ("does not think",)),
    Case("responses-store-a-string", RESP, {"input": "hi", "store": "yes"}, 400, "store"),
    Case("responses-metadata-a-list", RESP, {"input": "hi", "metadata": [1]}, 400, "metadata"),
    Case("responses-include-unknown", RESP, {"input": "hi", "include": ["file_search_call.results"]},
         400, "include"),
    Case("responses-truncation-auto", RESP, {"input": "hi", "truncation": "auto"}, 400,
         "truncation"),
    Case("responses-tool-choice-hosted", RESP, {"input": "hi", "tool_choice": {"type": "web_search"}},
         400, "tool_choice"),
    Case("responses-strict-schema-bad", RESP, {"input": "hi", "text": {"format": {
         "type": "json_schema", "name": "x", "schema": {"type": "wizard"}}}}, 400, "text.format",
         ("wizard",)),
    Case("count-tokens-bad-messages", MESS + "/count_tokens", {"messages": "x"}, 400, None,
         ("messages",)),
]  # fmt: skip


@pytest.mark.parametrize("case", AGENT_CASES, ids=[c.name for c in AGENT_CASES])
def test_bad_agent_input(http, case: Case):
    """/v1/responses answers in OpenAI's error body, /v1/messages in Anthropic's."""
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    resp = http.post(case.path, content=body, headers=case.headers)
    assert "Traceback" not in resp.text and ".py" not in resp.text
    if case.path == RESP:
        err = assert_openai_error(resp, case.status, case.param)
        if case.code is not None:
            assert err["code"] == case.code
        message = err["message"]
    else:
        assert resp.status_code == case.status, resp.text
        body = resp.json()
        assert set(body) == {"type", "error"} and body["type"] == "error"
        kind = {404: "not_found_error"}.get(case.status, "invalid_request_error")
        assert body["error"] == {"type": kind, "message": body["error"]["message"]}
        message = body["error"]["message"]
    for word in case.words:
        assert word in message, (word, message)
