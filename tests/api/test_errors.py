"""Every error path answers its status with the OpenAI error body, never a stack trace."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from starlette.testclient import TestClient

from llm_server.api.app import AppState, create_app
from llm_server.settings import DEFAULT_MAX_BODY_BYTES
from tests.api.helpers import assert_openai_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, **kw}


def comp(**kw) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **kw}


# (method, path, json body or raw bytes, status, param, words the message must contain)
CASES = [
    ("POST", CHAT, {}, 400, "messages", ["messages", "required"]),
    ("POST", CHAT, {"messages": []}, 400, "messages", ["messages", "non-empty"]),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        ["role", "user"],
    ),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].image_url",
        ["image_url", "url"],
    ),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "system", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
        ["image_url", "text"],
    ),
    ("POST", CHAT, {"messages": [{"role": "user", "content": ""}]}, 400, "messages", ["empty"]),
    ("POST", CHAT, chat(temperature=3), 400, "temperature", ["temperature", "0", "2"]),
    ("POST", CHAT, chat(top_p=1.5), 400, "top_p", ["top_p", "0", "1"]),
    ("POST", CHAT, chat(temperature="hot"), 400, "temperature", ["temperature", "number"]),
    ("POST", CHAT, chat(max_tokens=0), 400, "max_tokens", ["max_tokens", "at least 1"]),
    (
        "POST",
        CHAT,
        {"messages": MSG, "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
        ["max_completion_tokens", "at least 1"],
    ),
    ("POST", CHAT, chat(n=9), 400, "n", ["'n'", "between 1 and 8", "9"]),
    ("POST", CHAT, chat(top_k=-2), 400, "top_k", ["top_k", "-2"]),
    ("POST", CHAT, chat(min_p=1.5), 400, "min_p", ["min_p", "between 0 and 1"]),
    ("POST", CHAT, chat(frequency_penalty=2.5), 400, "frequency_penalty", ["-2 and 2"]),
    ("POST", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", ["tools"]),
    (
        "POST",
        CHAT,
        chat(logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
        ["top_logprobs", "0", "20"],
    ),
    ("POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs", ["top_logprobs", "logprobs"]),
    ("POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", ["stop", "4"]),
    ("POST", CHAT, chat(stop=[1]), 400, "stop", ["stop", "string"]),
    (
        "POST",
        CHAT,
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        ["stream_options", "stream"],
    ),
    (
        "POST",
        CHAT,
        chat(response_format={"type": "xml"}),
        400,
        "response_format.type",
        ["response_format.type", "json_schema"],
    ),
    ("POST", CHAT, chat(model="gpt-17"), 404, "model", ["gpt-17", "does not exist"]),
    ("POST", CHAT, b"{not json", 400, None, ["JSON"]),
    ("POST", CHAT, b"[1, 2]", 400, None, ["object"]),
    ("POST", COMP, {"max_tokens": 2}, 400, "prompt", ["prompt", "required"]),
    ("POST", COMP, comp(prompt=""), 400, "prompt", ["prompt", "empty"]),
    ("POST", COMP, comp(prompt=[[1, 2], [999999]]), 400, "prompt[1]", ["999999", "vocabulary"]),
    ("POST", COMP, comp(prompt=[5] * 5000), 400, "prompt", ["5000", "context"]),
    ("POST", COMP, comp(max_tokens=0), 400, "max_tokens", ["max_tokens", "echo"]),
    ("POST", COMP, comp(logprobs=30), 400, "logprobs", ["logprobs", "0", "20"]),
    (
        "POST",
        COMP,
        comp(echo=True, logprobs=1, max_tokens=5),
        400,
        "max_tokens",
        ["max_tokens", "0 or 1"],
    ),
    (
        "POST",
        COMP,
        comp(echo=True, logprobs=1, max_tokens=1, stream=True),
        400,
        "stream",
        ["stream"],
    ),
    ("POST", COMP, comp(n=0), 400, "n", ["'n'", "between 1 and 8"]),
    ("POST", COMP, comp(best_of=3), 400, "best_of", ["best_of"]),
    ("POST", COMP, comp(suffix="x"), 400, "suffix", ["suffix"]),
    ("POST", COMP, comp(n=2, echo=True, max_tokens=0), 400, "n", ["'n' must be 1"]),
    ("POST", COMP, comp(model="nope"), 404, "model", ["nope"]),
    ("POST", "/tokenize", {"prompt": 5}, 400, "prompt", ["prompt", "string"]),
    ("POST", "/detokenize", {"tokens": ["a"]}, 400, "tokens", ["tokens", "token ids"]),
    ("POST", "/detokenize", {"tokens": [-1]}, 400, "tokens", ["-1", "vocabulary"]),
    ("GET", "/v1/nothing-here", None, 404, None, ["/v1/nothing-here"]),
    ("GET", COMP, None, 405, None, ["GET", COMP]),
    ("DELETE", "/v1/models", None, 405, None, ["DELETE"]),
    ("POST", CHAT, b"x" * (DEFAULT_MAX_BODY_BYTES + 1), 413, None, ["limit"]),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param", "words"),
    CASES,
    ids=[f"{c[3]}-{c[1]}-{c[4]}-{i}" for i, c in enumerate(CASES)],
)
def test_error_paths(http, method, path, body, status, param, words):
    kwargs = {}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs = {"json": body}
    err = assert_openai_error(http.request(method, path, **kwargs), status, param)
    for word in words:
        assert word in err["message"], (word, err["message"])
    if status == 400 and param is not None:
        assert err["type"] == "invalid_request_error"


def test_413_without_content_length(http):
    """A chunked body is cut off at the limit too (no Content-Length to trust)."""

    def chunks():
        for _ in range(DEFAULT_MAX_BODY_BYTES // (1024 * 1024) + 1):
            yield b" " * (1024 * 1024)

    resp = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)


def test_503_while_loading():
    app = create_app(AppState(None, "still-loading"))
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path in [
            ("POST", CHAT),
            ("POST", COMP),
            ("POST", "/tokenize"),
            ("GET", "/tokenizer_info"),
        ]:
            resp = client.request(method, path, json=chat())
            err = assert_openai_error(resp, 503)
            assert err["code"] == "model_loading" and "loading" in err["message"]
            assert resp.headers["retry-after"] == "1"
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["ready"] is False
        assert client.get("/v1/models").json()["data"][0]["id"] == "still-loading"
        assert client.get("/metrics").status_code == 200


def test_429_when_full(live_server, tiny_model_path):
    """One request holds the only row (max_queued=0): the next is refused at once."""
    srv = live_server(tiny_model_path, concurrent=1, max_queued=0)
    sched = srv.service.scheduler
    lease = sched.acquire_lease(30)  # pause the scheduler so the first request stays put
    first: dict = {}

    def run_first() -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            first["resp"] = c.post(CHAT, json=chat(max_tokens=3))

    t = threading.Thread(target=run_first)
    try:
        t.start()
        deadline = time.monotonic() + 30
        while sched.stats().queued + sched.stats().rows_busy < 1:
            assert time.monotonic() < deadline, "first request never arrived"
            time.sleep(0.01)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for body in (chat(), chat(stream=True), comp()):
                path = COMP if "prompt" in body else CHAT
                resp = c.post(path, json=body)
                err = assert_openai_error(resp, 429)
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
                assert int(resp.headers["retry-after"]) >= 1
                assert "full" in err["message"]
    finally:
        lease.release()
        t.join(60)
    assert first["resp"].status_code == 200


def test_stack_trace_never_leaks(http, server, monkeypatch):
    """An unexpected exception in a handler becomes a plain 500 OpenAI error."""

    def boom(*a, **k):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.service.tokenizer, "apply_chat_template", boom)
    resp = http.post(CHAT, json=chat())
    err = assert_openai_error(resp, 500)
    assert "secret" not in resp.text and err["message"] == "internal server error"
