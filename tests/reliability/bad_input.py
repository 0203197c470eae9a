"""Shared pieces of the bad-input catalogue: the case record, request builders, the checks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from tests.api.helpers import assert_openai_error

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
EMB = "/v1/embeddings"
RESP = "/v1/responses"
MESS = "/v1/messages"
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


def mess(**kw) -> dict:
    return {"messages": MSG, "max_tokens": 2, "temperature": 0, **kw}


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


def post(http: httpx.Client, case: Case) -> httpx.Response:
    """Send the case's body (bytes as they are, a dict as JSON) with its headers."""
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    return http.post(case.path, content=body, headers=case.headers)


def check_openai_case(http: httpx.Client, case: Case) -> None:
    """The case gets its status, never a 500 or a leaked traceback; errors in OpenAI's body."""
    resp = post(http, case)
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


def check_still_serves(http: httpx.Client) -> None:
    """After a catalogue the server is idle, healthy, and still answers a chat request."""
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["rows_busy"] == 0 and body["queue_length"] == 0
    resp = http.post(CHAT, json=chat())
    assert resp.status_code == 200
