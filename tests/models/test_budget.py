"""The budget counts what is held and enforces it: a prompt whose KV could never fit is a 400
naming the numbers before any token; a KV growth that finds no room while the other models
serve is a 503 with Retry-After once its wait for room is over (an idle one is evicted for it;
test_budget_wait.py: a request waiting for room runs once a row is freed); /health and /metrics report
the bytes held by kind; loads count each model at its weights and first row."""

from __future__ import annotations

import gc
import json
import weakref

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from llm_server.engines.kv.budget import Account, BudgetRefused, HeldBytes, MemoryBudget
from llm_server.models.memory import FLOOR_POSITIONS, estimate_size, format_bytes
from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

from .test_memory import _hold, _let_go
from .test_on_demand import _statuses

POSITION = 2 * 2 * 2 * 16 * 4  # 2 layers x (K, V) x 2 kv heads x 16 dims x float32


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model whose rows reach 8192 positions (past the load's 2048-position floor)."""
    root = tmp_path_factory.mktemp("long")
    spec = TinySpec(arch="qwen3", seed=4, max_position_embeddings=8192)
    return build_tiny_checkpoint(root / "long", spec)


def _prompt(path, tokens: int) -> str:
    """A prompt of exactly `tokens` tokens for the checkpoint at `path`."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode("the cat sat on the mat and " * tokens).ids[:tokens]
    text = tok.decode(ids)
    assert len(tok.encode(text).ids) == tokens
    return text


def _ask(url: str, model: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_a_prompt_that_could_never_fit_is_refused_before_any_token(long_model):
    weights = estimate_size(long_model, 1, 8192).weights
    budget = weights + 3000 * POSITION  # KV for 3000 positions beside the weights, no more
    entries = [ModelEntry(id="long", source=str(long_model), context_length=8192)]
    with ManagedServer(entries, budget=budget) as srv:
        refused = _ask(srv.url, "long", _prompt(long_model, 2990), max_tokens=20)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "memory_budget_exceeded" and error["param"] == "max_tokens"
        room = srv.manager.slots["long"].service.engine.kv_room()
        assert error["message"] == (
            f"this request's KV at 3010 positions (its prompt and max_tokens) needs "
            f"{format_bytes(3010 * POSITION)} ({3010 * POSITION} bytes) but model 'long' can "
            f"hold at most {format_bytes(room)} ({room} bytes) of KV within the memory budget "
            "beside its weights and the pinned models; shorten the prompt or max_tokens, or "
            "raise --max-memory"
        )
        assert 2990 * POSITION < room < 3010 * POSITION
        # the daemon answers the next request, and one that fits just under the bound
        assert _ask(srv.url, "long", "the cat").status_code == 200
        assert _ask(srv.url, "long", _prompt(long_model, 2000), max_tokens=20).status_code == 200
        held = srv.manager.budget.held()["long"]
        assert held.total <= budget and held.kv >= 2020 * POSITION


def test_a_growth_with_no_room_while_the_others_serve_is_a_503_then_evicts_an_idle_one(
    tiny_models, long_model
):
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"])),
        ModelEntry(id="gamma", source=str(tiny_models["gamma"])),
        ModelEntry(id="long", source=str(long_model), context_length=8192),
    ]
    needed = [estimate_size(tiny_models[m], 1, None).needed for m in ("alpha", "gamma")]
    floor = estimate_size(long_model, 1, 8192).needed
    assert floor == estimate_size(long_model, 1, 8192).weights + FLOOR_POSITIONS * POSITION
    budget = sum(needed) + floor + 64 * 1024  # room for the long model's first 2048 positions
    # a request refused room waits 0.2s for it (nothing frees any: the others are held)
    with ManagedServer(entries, budget=budget, settings={"memory_wait": 0.2}) as srv:
        held = [srv.call(_hold(srv.manager, name)) for name in ("alpha", "gamma")]
        assert _ask(srv.url, "long", "the cat").status_code == 200  # within its floor
        long_prompt = _prompt(long_model, 3000)
        full = _ask(srv.url, "long", long_prompt)
        assert full.status_code == 503 and full.headers["Retry-After"] == "5"
        error = full.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert error["message"].startswith("memory budget: the KV store's growth of model 'long'")
        assert f"of the {format_bytes(budget)} budget is held" in error["message"]
        assert srv.manager.used() <= budget
        body = {"model": "long", "prompt": long_prompt, "max_tokens": 4, "stream": True}
        stream = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert stream.status_code == 200  # a stream's headers go before the prefill
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line[6:7] == "{"]
        assert events[-1]["error"]["code"] == "insufficient_memory"
        assert events[-1]["error"]["message"].startswith("memory budget: the KV store's growth")
        # the Messages and Responses streams end with the same refusal in their own shapes
        turn = [{"role": "user", "content": long_prompt}]
        body = {"model": "long", "messages": turn, "max_tokens": 4, "stream": True}
        stream = httpx.post(f"{srv.url}/v1/messages", json=body, timeout=120)
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line[6:7] == "{"]
        assert events[-1]["type"] == "error"
        assert events[-1]["error"]["type"] == "overloaded_error"
        assert events[-1]["error"]["message"].startswith("memory budget: the KV store's growth")
        body = {"model": "long", "input": turn, "max_output_tokens": 4, "stream": True}
        stream = httpx.post(f"{srv.url}/v1/responses", json=body, timeout=120)
        events = [json.loads(line[6:]) for line in stream.text.splitlines() if line[6:7] == "{"]
        failed = events[-1]["response"]
        assert events[-1]["type"] == "response.failed"
        assert failed["error"]["code"] == "insufficient_memory"
        assert failed["error"]["message"].startswith("memory budget: the KV store's growth")
        srv.call(_let_go(srv.manager, held[0]))  # alpha idle: evicted for the growth
        assert _ask(srv.url, "long", long_prompt).status_code == 200
        assert _statuses(srv.url) == {"alpha": "unloaded", "gamma": "loaded", "long": "loaded"}
        assert srv.manager.used() <= budget
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
        long_held = health["models"]["long"]["held"]
        assert long_held["kv"] >= 3000 * POSITION
        assert long_held["total"] == sum(long_held[k] for k in ("weights", "kv", "prefix_cache"))
        assert health["memory"]["held"]["total"] <= budget
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        held_metric = {
            (sample.labels["model"], sample.labels["kind"]): sample.value
            for family in text_string_to_metric_families(metrics)
            if family.name == "llm_server_held_bytes"
            for sample in family.samples
        }
        assert held_metric[("long", "kv")] >= 3000 * POSITION
        assert ("alpha", "total") not in held_metric  # unloaded: holds nothing
        srv.call(_let_go(srv.manager, held[1]))


def test_reserve_counts_a_growth_within_the_floor_as_held_already():
    budget = MemoryBudget(1000)
    account = budget.account("a")
    held = {"kv": 0}
    account.measure = lambda: HeldBytes(weights=300, kv=held["kv"])
    budget.reserve_floor("a", 600)  # weights and first row
    assert budget.used() == 600
    assert account.reserve(300)  # 300 + 300 within the floor: nothing more counted
    held["kv"] = 300
    assert account.reserve(400)  # 1000 in all: the limit
    assert not account.reserve(401)
    other = budget.account("b")
    other.measure = lambda: HeldBytes(weights=100)
    assert budget.used() == 700 and not account.reserve(301) and account.reserve(300)
    shrunk: list[int] = []
    account.shrink = lambda n: shrunk.append(n) or 0
    assert not account.reserve(350) and shrunk == [50]  # its prefix cache asked for the rest
    assert not account.reserve(350, own_cache=False) and shrunk == [50]
    assert isinstance(account.refused("x", 1), BudgetRefused)
    assert isinstance(account, Account)


def test_an_unloaded_model_leaves_nothing_alive(tiny_models):
    # the budget account once kept an evicted engine (and all its arrays) alive
    entries = [ModelEntry(id="alpha", source=str(tiny_models["alpha"]))]
    with ManagedServer(entries) as srv:
        assert _ask(srv.url, "alpha", "the cat").status_code == 200
        engine = weakref.ref(srv.manager.slots["alpha"].service.engine)
        assert httpx.post(f"{srv.url}/v1/models/alpha/unload", timeout=60).status_code == 200
        gc.collect()
        assert engine() is None
        assert srv.manager.used() == 0 and srv.manager.budget.held() == {}


def test_one_model_under_max_memory_fits_its_context_and_reports_held_bytes(
    tiny_models, long_model, make_service
):
    weights = estimate_size(long_model, 1, None).weights
    svc = make_service(long_model, max_memory=weights + 3000 * POSITION)
    engine = svc.engine
    assert engine.context_length == 2816  # what one row holds beside the weights, in 256s
    assert engine.budget_bytes() == weights + 3000 * POSITION
    assert engine.held_bytes().weights == engine.weight_bytes() == weights
    assert svc.memory_refusal(2900) is None and svc.memory_refusal(3001) is not None
    with pytest.raises(BudgetRefused, match="memory budget: the weights of model"):
        make_service(tiny_models["alpha"], max_memory=1000)


def test_one_model_server_refuses_what_never_fits_and_reports_memory(long_model, live_server):
    weights = estimate_size(long_model, 1, None).weights
    budget = weights + 3000 * POSITION
    srv = live_server(long_model, max_memory=budget, context_length=8192)
    refused = _ask(srv.url, "long", _prompt(long_model, 2990), max_tokens=20)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "memory_budget_exceeded"
    assert _ask(srv.url, "long", "the cat").status_code == 200
    memory = httpx.get(f"{srv.url}/health", timeout=30).json()["memory"]
    assert memory["budget"] == budget and memory["held"]["weights"] == weights
    assert memory["held"]["kv"] > 0 and memory["held"]["total"] <= budget
    metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert 'llm_server_held_bytes{kind="weights"}' in metrics
