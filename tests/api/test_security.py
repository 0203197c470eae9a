"""API key on /v1/* (401 unless the Bearer token matches) and CORS only when asked for."""

from __future__ import annotations

import httpx
import openai
import pytest

from llm_server.api.shared.security import API_KEY_ENV
from tests.api.helpers import assert_openai_error

KEY = "s3cret-key"


@pytest.fixture
def keyed(live_server, tiny_model_path):
    return live_server(
        tiny_model_path, app_options={"api_key": KEY, "cors_origins": ["http://app.local"]}
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
    ],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
def test_missing_or_wrong_key_is_401(keyed, headers):
    with httpx.Client(base_url=keyed.url, headers=headers) as c:
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]:
            resp = c.request(method, path, json={"messages": [{"role": "user", "content": "hi"}]})
            err = assert_openai_error(resp, 401)
            assert err["type"] == "authentication_error" and "Bearer" in err["message"]
            assert resp.headers["www-authenticate"] == "Bearer"


def test_right_key_works_and_non_v1_routes_stay_open(keyed):
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [keyed.state.model_id]
    resp = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert resp.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(keyed.url + "/health").status_code == 200


def test_key_from_environment(monkeypatch, tiny_model_path, live_server):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    srv = live_server(tiny_model_path)
    assert httpx.get(srv.url + "/v1/models").status_code == 401
    ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer from-env"})
    assert ok.status_code == 200


def test_cors_only_for_the_given_origin(keyed, server):
    pre = {
        "Origin": "http://app.local",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    resp = httpx.options(keyed.url + "/v1/chat/completions", headers=pre)
    assert resp.status_code == 200  # preflight needs no key
    assert resp.headers["access-control-allow-origin"] == "http://app.local"
    other = httpx.options(
        keyed.url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil"}
    )
    assert "access-control-allow-origin" not in other.headers
    # Without --cors-origin there are no CORS headers at all.
    plain = httpx.get(server.url + "/v1/models", headers={"Origin": "http://app.local"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
