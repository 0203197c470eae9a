"""The memory budget: LRU eviction of idle unpinned models, pinned models stay, a model too big
for the budget is refused with its sizes, a corrupt model fails alone."""

from __future__ import annotations

import shutil

import httpx

from llm_server.models.memory import estimate_size, format_bytes
from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer

from .test_on_demand import _complete, _statuses, wait_status


def _budget_for_two(tiny_models) -> int:
    sizes = [estimate_size(p, 1, None).needed for p in tiny_models.values()]
    assert 2 * max(sizes) < 3 * min(sizes)  # a budget exists that holds two, never three
    return 2 * max(sizes)


def test_estimate_counts_weights_kv_rows_and_prefix_cache(tiny_models, make_service):
    size = estimate_size(tiny_models["alpha"], 1, None)
    svc = make_service(tiny_models["alpha"])
    assert size.weights == svc.engine.weight_bytes()
    assert size.prefix_cache == svc.engine.prefix_cache.stats().max_bytes
    # 2 layers x (K, V) x 2 kv heads x 16 dims x 1024 positions x (1 row + 8 scoring rows)
    # x 4 bytes
    assert svc.engine.score_rows == 8
    assert size.kv == 2 * 2 * 2 * 16 * 1024 * (1 + 8) * 4


def test_lru_eviction_under_a_budget_that_holds_two(tiny_models, entries):
    with ManagedServer(entries, budget=_budget_for_two(tiny_models)) as srv:
        _complete(srv.url, "alpha")
        _complete(srv.url, "beta")
        _complete(srv.url, "alpha")  # beta is now the least recently used
        assert _complete(srv.url, "gamma").status_code == 200
        assert _statuses(srv.url) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        _complete(srv.url, "beta")  # alpha is the least recently used now
        assert _statuses(srv.url) == {"alpha": "unloaded", "beta": "loaded", "gamma": "loaded"}
        memory = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["memory"]
        assert memory["used"] <= memory["budget"]


def test_pinned_model_is_never_evicted(tiny_models):
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"]), pinned=True),
        ModelEntry(id="beta", source=str(tiny_models["beta"])),
        ModelEntry(id="gamma", source=str(tiny_models["gamma"])),
    ]
    with ManagedServer(entries, budget=_budget_for_two(tiny_models), idle_unload=0) as srv:
        wait_status(srv.url, "alpha", "loaded")  # pinned models load at start
        for name in ("beta", "gamma", "beta", "gamma"):
            assert _complete(srv.url, name).status_code == 200
            assert _statuses(srv.url)["alpha"] == "loaded"
        assert _complete(srv.url, "alpha", keep_alive=0).status_code == 200
        assert _statuses(srv.url)["alpha"] == "loaded"  # neither idle_unload 0 nor keep_alive 0


def test_a_model_too_big_for_the_budget_is_refused_with_sizes(tiny_models, entries):
    budget = estimate_size(tiny_models["beta"], 1, None).weights  # no room for one row
    size = estimate_size(tiny_models["beta"], 1, None, budget=budget)  # as the daemon's
    assert size.context == 256 and size.needed > budget  # the shortest context, still over
    with ManagedServer(entries, budget=budget) as srv:
        response = _complete(srv.url, "beta")
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "model_too_large"
        assert error["message"] == (
            f"model 'beta' needs {format_bytes(size.needed)} ({size.needed} bytes: weights "
            f"{format_bytes(size.weights)}, its first row's KV {format_bytes(size.floor)}) but "
            f"the memory budget is {format_bytes(budget)} ({budget} bytes); raise "
            "--max-memory or lower its context_length"
        )
        assert _statuses(srv.url)["beta"] == "unloaded"


def test_corrupt_weights_fail_alone_and_retry_on_the_next_request(tiny_models, tmp_path):
    broken = shutil.copytree(tiny_models["gamma"], tmp_path / "broken")
    weights = broken / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])  # the header survives, the tensors do not
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"])),
        ModelEntry(id="broken", source=str(broken)),
    ]
    with ManagedServer(entries) as srv:
        good = _complete(srv.url, "alpha").json()["choices"]
        failed = _complete(srv.url, "broken")
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["code"] == "model_load_failed"
        assert error["message"].startswith("model 'broken' failed to load: ")
        models = {m["id"]: m for m in httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"]}
        assert models["broken"]["status"] == "unloaded"
        assert models["broken"]["error"] == error["message"].removeprefix(
            "model 'broken' failed to load: "
        )
        assert _complete(srv.url, "alpha").json()["choices"] == good  # the others serve on
        weights.write_bytes(intact)  # repaired: the next request retries the load
        assert _complete(srv.url, "broken").status_code == 200
        assert _statuses(srv.url)["broken"] == "loaded"


def test_unloading_frees_the_model(tiny_models, entries):
    import gc
    import weakref

    import mlx.core as mx

    with ManagedServer(entries) as srv:
        _complete(srv.url, "alpha")
        before = mx.get_active_memory()
        _complete(srv.url, "beta")
        service = weakref.ref(srv.manager.slots["beta"].service)
        engine = weakref.ref(service().engine)
        weights = engine().weight_bytes()
        assert mx.get_active_memory() - before >= weights
        gone = httpx.post(f"{srv.url}/v1/models/beta/unload", timeout=60)
        assert gone.json()["status"] == "unloaded"
        gc.collect()
        assert service() is None and engine() is None
        assert mx.get_active_memory() <= before


async def _hold(manager, name):
    return await manager.acquire(name)


async def _let_go(manager, slot):
    manager.release(slot)


def test_a_model_serving_requests_is_never_unloaded(tiny_models, entries):
    with ManagedServer(entries, budget=_budget_for_two(tiny_models), load_wait=0.2) as srv:
        held = srv.call(_hold(srv.manager, "alpha"))  # a request running on alpha
        _complete(srv.url, "beta")  # alpha is now the least recently used, but busy
        assert _complete(srv.url, "gamma").status_code == 200
        assert _statuses(srv.url) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        busy = httpx.post(f"{srv.url}/v1/models/alpha/unload", timeout=60)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
        also = srv.call(_hold(srv.manager, "gamma"))
        full = _complete(srv.url, "beta")  # both loaded models serve: no room within 0.2 s
        assert full.status_code == 503 and full.headers["Retry-After"] == "5"
        assert full.json()["error"]["code"] == "insufficient_memory"
        assert "none went idle in 0.2s" in full.json()["error"]["message"]
        srv.call(_let_go(srv.manager, held))
        srv.call(_let_go(srv.manager, also))
        assert _complete(srv.url, "beta").status_code == 200  # alpha, now idle and LRU, went
        assert _statuses(srv.url) == {"alpha": "unloaded", "beta": "loaded", "gamma": "loaded"}
