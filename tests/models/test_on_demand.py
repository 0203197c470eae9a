"""Three tiny models behind one daemon: each request served by the model it names, loaded on
demand; answers equal a single-model server's; unknown names 404; load and unload routes."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer

PROMPT = "The capital of France is"


def _complete(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _statuses(url: str) -> dict[str, str]:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"]: m["status"] for m in data}


def wait_status(url: str, model: str, status: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _statuses(url)[model] != status:
        assert time.monotonic() < deadline, f"{model} never became {status}: {_statuses(url)}"
        time.sleep(0.05)


def test_concurrent_requests_each_equal_a_single_model_server(
    tiny_models, entries, live_server, default_model_path
):
    models = {**tiny_models, "smol": default_model_path}  # and the embedded default
    single = {}
    for name, path in models.items():
        srv = live_server(path)
        single[name] = _complete(srv.url, None).json()["choices"][0]["text"]
    assert len(set(single.values())) == 4  # four different models
    entries = [*entries, ModelEntry(id="smol", source=str(default_model_path))]
    with ManagedServer(entries) as srv:
        assert set(_statuses(srv.url).values()) == {"unloaded"}
        names = [*models] * 2
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda n: _complete(srv.url, n), names))
        for name, response in zip(names, answers, strict=True):
            assert response.status_code == 200, response.text
            assert response.json()["model"] == name
            assert response.json()["choices"][0]["text"] == single[name]
        assert set(_statuses(srv.url).values()) == {"loaded"}
        health = httpx.get(f"{srv.url}/health", timeout=30).json()["models"]
        assert all(h["prefix_cache"]["max_bytes"] > 0 for h in health.values())  # one each
        chat = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={
                "model": "beta",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
            timeout=60,
        )
        assert chat.status_code == 200 and chat.json()["model"] == "beta"


def test_unknown_model_is_404_model_not_found(entries):
    with ManagedServer(entries) as srv:
        response = _complete(srv.url, "no-such-model")
        assert response.status_code == 404
        assert response.json()["error"] == {
            "message": "model 'no-such-model' does not exist; this server serves: alpha, beta, gamma",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
        assert set(_statuses(srv.url).values()) == {"unloaded"}  # nothing loaded for it


def test_alias_and_absent_model_and_tokenize(tiny_models):
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"]), aliases=("gpt-4o-mini",)),
        ModelEntry(id="beta", source=str(tiny_models["beta"])),
    ]
    with ManagedServer(entries) as srv:
        by_alias = _complete(srv.url, "gpt-4o-mini")
        assert by_alias.status_code == 200 and by_alias.json()["model"] == "alpha"
        by_default = _complete(srv.url, None)  # no model: the registry's first entry
        assert by_default.json()["choices"] == by_alias.json()["choices"]
        tok = httpx.post(
            f"{srv.url}/tokenize", json={"model": "beta", "prompt": PROMPT}, timeout=60
        )
        assert tok.status_code == 200 and tok.json()["count"] > 0
        assert _statuses(srv.url) == {"alpha": "loaded", "beta": "loaded"}


def test_load_and_unload_routes_behind_the_api_key(entries):
    with ManagedServer(entries, api_key="sekret") as srv:
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(f"{srv.url}/v1/models/beta/load", timeout=60).status_code == 401
        loaded = httpx.post(f"{srv.url}/v1/models/beta/load", headers=auth, timeout=60)
        assert loaded.status_code == 200
        body = loaded.json()
        assert body["status"] == "loaded" and body["size_bytes"] > 0 and body["last_used"]
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
        assert health["models"]["beta"]["status"] == "loaded"
        assert health["models"]["alpha"] == {"status": "unloaded", "error": None}
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        assert 'llm_server_model_loaded{model="beta"} 1.0' in metrics
        assert 'llm_server_model_loaded{model="alpha"} 0.0' in metrics
        gone = httpx.post(f"{srv.url}/v1/models/beta/unload", headers=auth, timeout=60)
        assert gone.status_code == 200 and gone.json()["status"] == "unloaded"
        missing = httpx.post(f"{srv.url}/v1/models/nope/load", headers=auth, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_single_model_server_refuses_load_routes(tiny_model_path, live_server):
    srv = live_server(tiny_model_path)
    response = httpx.post(f"{srv.url}/v1/models/x/load", timeout=30)
    assert response.status_code == 404
    assert "--models FILE" in response.json()["error"]["message"]


@pytest.mark.parametrize("keep_alive", [0, "0s"])
def test_keep_alive_zero_unloads_after_the_request(entries, keep_alive):
    with ManagedServer(entries) as srv:
        assert _complete(srv.url, "gamma", keep_alive=keep_alive).status_code == 200
        wait_status(srv.url, "gamma", "unloaded")
        bad = _complete(srv.url, "gamma", keep_alive="soon")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_idle_ttl_unloads_and_the_next_request_reloads(tiny_models):
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"]), idle_ttl=0.3),
        ModelEntry(id="beta", source=str(tiny_models["beta"])),
    ]
    with ManagedServer(entries) as srv:
        first = _complete(srv.url, "alpha").json()["choices"]
        _complete(srv.url, "beta")
        wait_status(srv.url, "alpha", "unloaded")
        assert _statuses(srv.url)["beta"] == "loaded"  # no TTL: stays
        assert _complete(srv.url, "alpha").json()["choices"] == first


def test_every_api_serves_the_model_it_names(entries):
    with ManagedServer(entries) as srv:
        emb = httpx.post(
            f"{srv.url}/v1/embeddings", json={"model": "beta", "input": "hi"}, timeout=60
        )
        assert emb.status_code == 200 and emb.json()["model"] == "beta"
        resp = httpx.post(
            f"{srv.url}/v1/responses",
            json={"model": "gamma", "input": "hi", "max_output_tokens": 3},
            timeout=60,
        )
        assert resp.status_code == 200 and resp.json()["model"] == "gamma"
        msg = httpx.post(
            f"{srv.url}/v1/messages",
            json={
                "model": "alpha",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=60,
        )
        assert msg.status_code == 200 and msg.json()["model"] == "alpha"
        info = httpx.get(f"{srv.url}/tokenizer_info", params={"model": "beta"}, timeout=60)
        assert info.status_code == 200 and info.json()["name_or_path"] == "beta"
        missing = httpx.post(
            f"{srv.url}/v1/messages",
            json={
                "model": "nope",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}],
            },
            timeout=60,
        )
        assert missing.status_code == 404
        assert missing.json()["type"] == "error"  # Anthropic's error shape on /v1/messages
        assert set(_statuses(srv.url).values()) == {"loaded"}


def test_the_openai_sdk_lists_retrieves_and_calls_registered_models(entries):
    """The real openai client against the daemon: models.list() holds every registered model
    with its status and input modalities, retrieve() one, a chat naming a model loads it, an
    unknown one is 404."""
    import openai

    with ManagedServer(entries) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        listed = client.models.list().data
        assert sorted(m.id for m in listed) == ["alpha", "beta", "gamma"]
        assert {m.model_extra["status"] for m in listed} == {"unloaded"}
        # what a model reads is known once it is loaded (its service's vision renderer)
        assert [m.model_extra["input_modalities"] for m in listed] == [None] * 3
        chat = client.chat.completions.create(
            model="gamma", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.model == "gamma" and chat.usage.completion_tokens > 0
        gamma = client.models.retrieve("gamma")
        assert gamma.id == "gamma" and gamma.model_extra["status"] == "loaded"
        assert gamma.model_extra["input_modalities"] == ["text"]
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert missing.value.body["code"] == "model_not_found"
