"""The log format, SSE aggregation and comparison, without a model."""

from __future__ import annotations

import json

import pytest

from replay.compare import compare, first_difference, is_deterministic
from replay.log import LogEntry, Timings, parse_line
from replay.report import percentile
from replay.sse import aggregate, sse_events


def _sse(*payloads: object) -> str:
    return "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads)


def test_a_line_round_trips() -> None:
    entry = LogEntry(
        "/v1/chat/completions", {"messages": []}, {"choices": []}, 200, True,
        Timings(0.001, 0.02, 0.3), "fp_x", "2025-01-01T00:00:00.000Z",
    )  # fmt: skip
    again = parse_line(entry.to_json(), line=7)
    assert again == LogEntry(**{**entry.__dict__, "line": 7})


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{", "not JSON"),
        ("[1]", "not a JSON object"),
        (
            '{"v": 2, "endpoint": "/x", "request": {}, "response": {}, "status": 200}',
            "log version 2",
        ),
        ('{"v": 1, "endpoint": "/x", "request": [], "response": {}, "status": 200}', "'request'"),
    ],
)
def test_bad_lines_say_why(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_line(text)


def test_chat_stream_aggregates_to_the_non_stream_body() -> None:
    base = {"id": "c1", "created": 1, "model": "m", "system_fingerprint": "fp"}
    raw = _sse(
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {"content": "is"}, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
        "[DONE]",
    )  # fmt: skip
    body = aggregate("/v1/chat/completions", sse_events(raw))
    assert body["object"] == "chat.completion" and body["system_fingerprint"] == "fp"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Paris"}, "finish_reason": "stop", "logprobs": None}
    ]  # fmt: skip
    assert body["usage"]["completion_tokens"] == 2


def test_completion_stream_aggregates_per_choice_with_logprobs() -> None:
    def lp(t):
        return {
            "tokens": [t],
            "token_logprobs": [-0.5],
            "top_logprobs": [{t: -0.5}],
            "text_offset": [0],
        }

    raw = _sse(
        {"id": "x", "choices": [{"index": 1, "text": "b", "logprobs": lp("b"), "finish_reason": None}]},
        {"id": "x", "choices": [{"index": 0, "text": "a", "logprobs": lp("a"), "finish_reason": "length"}]},
        {"id": "x", "choices": [{"index": 1, "text": "c", "logprobs": lp("c"), "finish_reason": "stop"}]},
        {"error": {"message": "boom", "code": "engine_error"}},
    )  # fmt: skip
    body = aggregate("/v1/completions", sse_events(raw))
    assert [c["text"] for c in body["choices"]] == ["a", "bc"]
    assert body["choices"][1]["logprobs"]["tokens"] == ["b", "c"]
    assert body["choices"][1]["finish_reason"] == "stop"
    assert body["error"]["code"] == "engine_error"


def test_compare_finds_the_first_differing_position() -> None:
    chat = lambda s: {"choices": [{"message": {"content": s}, "finish_reason": "stop"}]}  # noqa: E731
    assert compare("/v1/chat/completions", 200, chat("Paris"), 200, chat("Paris")) is None
    d = compare("/v1/chat/completions", 200, chat("Paris"), 200, chat("Pariz"))
    assert (d.field, d.unit, d.position) == ("choices[0].message.content", "char", 4)
    assert compare("/v1/chat/completions", 200, chat("a"), 429, None).field == "status"

    def scored(v):
        return {
            "choices": [
                {"text": "ab", "logprobs": {"tokens": ["a", "b"], "token_logprobs": [None, v]}}
            ]
        }

    assert compare("/v1/completions", 200, scored(-1.0), 200, scored(-1.0 + 1e-6)) is None
    d = compare("/v1/completions", 200, scored(-1.0), 200, scored(-1.5))
    assert (d.field, d.unit, d.position) == ("choices[0].logprobs.token_logprobs", "token", 1)
    assert first_difference("abc", "ab") == 2


def test_what_counts_as_deterministic() -> None:
    assert is_deterministic("/v1/chat/completions", {"temperature": 0})
    assert not is_deterministic("/v1/chat/completions", {})  # the default temperature is 1
    assert not is_deterministic("/v1/chat/completions", {"temperature": 0.7, "seed": 1})
    assert is_deterministic("/v1/completions", {"echo": True, "logprobs": 0, "max_tokens": 1})
    assert is_deterministic("/tokenize", {"prompt": "x"})


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile([], 50)) == (
        50.0,
        99.0,
        None,
    )
