"""The page's routes over HTTP (no browser): headers, `--no-ui`, the one poll on one model and
with the request log on, and the same-origin check on load and unload."""

from __future__ import annotations

import httpx

from llm_server.cli import build_parser
from llm_server.settings import ServerSettings
from llm_server.testing.managed import ManagedServer

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}


def test_the_page_and_its_files_come_with_a_strict_content_policy(live_server, tiny_model_path):
    srv = live_server(tiny_model_path)
    for path in ("/", "/ui/app.js", "/ui/style.css"):
        response = httpx.get(srv.url + path)
        assert response.status_code == 200, path
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "connect-src 'self'" in policy
        assert response.headers["x-content-type-options"] == "nosniff"
    page = httpx.get(srv.url + "/").text
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
    assert httpx.get(srv.url + "/ui/missing.js").status_code == 404


def test_no_ui_serves_no_page(live_server, tiny_model_path):
    assert ServerSettings.from_args(build_parser().parse_args(["--no-ui"])).http.ui is False
    assert ServerSettings.from_args(build_parser().parse_args([])).http.ui is True
    srv = live_server(tiny_model_path, app_options={"ui": False})
    assert httpx.get(srv.url + "/").status_code == 404
    assert httpx.get(srv.url + "/ui/api/state").status_code == 404
    assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_one_model_polls_as_one_loaded_model_with_its_requests(live_server, tiny_model_path):
    srv = live_server(tiny_model_path, concurrent=2)
    assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200
    refused = httpx.post(srv.url + "/v1/chat/completions", json={"messages": []})
    assert refused.status_code == 400
    state = httpx.get(srv.url + "/ui/api/state").json()
    [model] = state["models"]
    assert (model["status"], model["manageable"]) == ("loaded", False)
    assert model["context_length"] > 0
    assert state["now"]["rows"] == 2 and state["now"]["generated_tokens"] == 5
    newest, ok = state["requests"][:2]
    assert newest["status"] == 400 and newest["reason"] == "'messages' must be a non-empty array"
    assert (ok["status"], ok["completion_tokens"], ok["route"]) == (200, 5, "/v1/chat/completions")
    assert 0 < ok["ttft"] <= ok["duration"]
    assert state["now"]["ttft"]["count"] == 1 and state["requests_source"] == "memory"
    # the page asks for no requests while its Requests view is hidden
    assert httpx.get(srv.url + "/ui/api/state?requests=0").json()["requests"] == []
    assert len(httpx.get(srv.url + "/ui/api/state?requests=1").json()["requests"]) == 1
    assert httpx.get(srv.url + "/ui/api/state?requests=x").status_code == 400


def test_with_the_request_log_on_the_requests_come_from_it(live_server, tiny_model_path, tmp_path):
    from llm_server.api.shared.request_log import RequestRecorder

    recorder = RequestRecorder(tmp_path / "log.jsonl")
    try:
        srv = live_server(tiny_model_path, app_options={"request_log": recorder})
        assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT).status_code == 200
        state = httpx.get(srv.url + "/ui/api/state").json()
    finally:
        recorder.close()
    assert state["requests_source"] == "request log"
    [entry] = state["requests"]
    assert (entry["status"], entry["completion_tokens"], entry["prompt_tokens"] > 0) == (
        200,
        5,
        True,
    )
    assert entry["model"] == srv.state.model_id and entry["ttft"] is not None


def test_load_and_unload_refuse_another_origin(ui_models):
    allowed = "http://app.example"
    with ManagedServer(ui_models, cors_origins=[allowed]) as srv:
        load = f"{srv.url}/v1/models/alpha/load"
        cross = httpx.post(load, headers={"Origin": "http://elsewhere.example"})
        assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_origin"
        fetched = httpx.post(load, headers={"Sec-Fetch-Site": "cross-site"})
        assert fetched.status_code == 403
        assert httpx.get(f"{srv.url}/v1/models/alpha").json()["status"] == "unloaded"
        assert httpx.post(load, headers={"Origin": srv.url}).status_code == 200  # the page
        unload = f"{srv.url}/v1/models/alpha/unload"
        assert httpx.post(unload, headers={"Origin": allowed}).status_code == 200  # --cors-origin
        assert httpx.post(load).status_code == 200  # a client that is no browser


def test_the_page_files_ship_in_the_package():
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = patterns["package-data"]["llm_server"]
    static = root / "llm_server" / "api" / "ui" / "static"
    files = [p.relative_to(root / "llm_server").as_posix() for p in static.iterdir()]
    assert {"api/ui/static/index.html", "api/ui/static/app.js", "api/ui/static/style.css"} <= set(
        files
    )
    assert [f for f in files if not any(fnmatch.fnmatch(f, p) for p in shipped)] == []
