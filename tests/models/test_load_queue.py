"""A request for a model that does not fit while every other model serves waits for the first
to go idle, which is then evicted (as Ollama queues), instead of a 503; past --load-wait it is a
503 naming the numbers; two loads racing under a budget for one never both hold it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time

from llm_server.models.memory import estimate_size, format_bytes
from llm_server.models.registry import ModelEntry
from llm_server.models.slots import Status
from llm_server.testing.managed import ManagedServer

from .test_memory import _budget_for_two, _hold, _let_go
from .test_on_demand import _complete, _statuses


def _until(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_load_waits_for_the_first_model_to_go_idle_and_evicts_it(tiny_models, entries):
    with ManagedServer(entries, budget=_budget_for_two(tiny_models)) as srv:
        alpha = srv.call(_hold(srv.manager, "alpha"))
        gamma = srv.call(_hold(srv.manager, "gamma"))  # both loaded models serve: no room
        beta = srv.manager.slots["beta"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_complete, srv.url, "beta")
            _until(lambda: beta.waiting == 1 and srv.manager._wanting_room)
            time.sleep(0.3)
            assert not waiting.done() and beta.status is Status.LOADING
            srv.call(_let_go(srv.manager, gamma))  # gamma goes idle first: it is evicted
            assert waiting.result(60).status_code == 200
        assert _statuses(srv.url) == {"alpha": "loaded", "beta": "loaded", "gamma": "unloaded"}
        assert srv.manager.used() <= srv.manager.config.budget
        srv.call(_let_go(srv.manager, alpha))


def test_past_the_wait_a_503_names_the_numbers(tiny_models, entries):
    budget = _budget_for_two(tiny_models)
    with ManagedServer(entries, budget=budget, load_wait=0.3) as srv:
        held = [srv.call(_hold(srv.manager, name)) for name in ("alpha", "gamma")]
        started = time.monotonic()
        full = _complete(srv.url, "beta")
        assert time.monotonic() - started >= 0.3
        assert full.status_code == 503 and full.headers["Retry-After"] == "5"
        error = full.json()["error"]
        assert error["code"] == "insufficient_memory"
        size = estimate_size(tiny_models["beta"], 1, None).needed
        used = srv.manager.used()
        assert error["message"] == (
            f"model 'beta' needs {format_bytes(size)} but {format_bytes(used)} of the "
            f"{format_bytes(budget)} budget is held by models that are pinned or serving "
            f"(alpha {format_bytes(srv.manager.slots['alpha'].counted)}, 1 requests, "
            f"gamma {format_bytes(srv.manager.slots['gamma'].counted)}, 1 requests), and none "
            "went idle in 0.3s; retry later"
        )
        for slot in held:
            srv.call(_let_go(srv.manager, slot))
        assert _complete(srv.url, "beta").status_code == 200  # room now: alpha evicted


def test_a_model_that_never_fits_beside_the_pinned_ones_is_refused_at_once(tiny_models):
    entries = [
        ModelEntry(id="alpha", source=str(tiny_models["alpha"]), pinned=True),
        ModelEntry(id="beta", source=str(tiny_models["beta"])),
    ]
    alpha = estimate_size(tiny_models["alpha"], 1, None).needed
    budget = alpha + estimate_size(tiny_models["beta"], 1, None).needed - 1
    with ManagedServer(entries, budget=budget) as srv:
        _until(lambda: srv.manager.slots["alpha"].status is Status.LOADED)
        started = time.monotonic()
        refused = _complete(srv.url, "beta")
        assert time.monotonic() - started < 5  # not the 60 s wait: nothing could ever free
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == (
            f"model 'beta' needs {format_bytes(budget - alpha + 1)} but pinned models hold "
            f"{format_bytes(alpha)} of the {format_bytes(budget)} budget; unpin a model or "
            "raise --max-memory"
        )


def test_two_loads_racing_under_a_budget_for_one_never_both_hold_it(tiny_models, entries):
    entries = entries[:2]
    sizes = [estimate_size(tiny_models[e.id], 1, None).needed for e in entries]
    budget = sum(sizes) - 1  # either fits, never both
    with ManagedServer(entries, budget=budget) as srv:
        make = srv.manager._factory
        gate = threading.Event()
        seen: list[list[str]] = []  # at each load's start: the models holding memory

        def slow(entry, path, *more):  # each load lingers so the other request arrives meanwhile
            seen.append([s.entry.id for s in srv.manager.slots.values() if s.service])
            gate.wait(0.5)
            return make(entry, path, *more)

        srv.manager._factory = slow
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda m: _complete(srv.url, m), ["alpha", "beta"] * 2))
        assert [a.status_code for a in answers] == [200] * 4
        assert all(held == [] for held in seen), seen  # the other was unloaded first
        assert srv.manager.used() <= budget
        assert sorted(_statuses(srv.url).values()) == ["loaded", "unloaded"]


async def _request_as_the_unload_finishes(manager, name: str):
    """Unload `name` and have a request for it run in the loop turn between the unload's end
    and its task's done callback (where, under load, a client's request can land)."""
    go = asyncio.Event()
    unload = manager._unload

    async def unload_then_wake(slot):
        await unload(slot)
        go.set()  # the request's next step is queued before the task's done callback

    async def request():
        await go.wait()
        return await manager.acquire(name)

    manager._unload = unload_then_wake
    try:
        arriving = asyncio.ensure_future(request())
        await manager.unload(name)
        return await arriving
    finally:
        manager._unload = unload


def test_a_request_arriving_as_its_model_finishes_unloading_loads_it_again(tiny_models, entries):
    # the CI stall: acquire() awaited the finished unload task (which returns without
    # yielding), saw the model still unloaded, and spun on the event loop forever
    with ManagedServer(entries, budget=_budget_for_two(tiny_models)) as srv:
        assert _complete(srv.url, "alpha").status_code == 200
        pending = asyncio.run_coroutine_threadsafe(
            _request_as_the_unload_finishes(srv.manager, "alpha"), srv.loop
        )
        slot = pending.result(30)
        assert slot.status is Status.LOADED and slot.active == 1
        srv.call(_let_go(srv.manager, slot))
        assert _complete(srv.url, "alpha").status_code == 200


def test_a_load_queued_behind_one_waiting_for_room_waits_no_longer_than_load_wait(
    tiny_models, entries
):
    # a fourth entry (alpha's files under another id) queues behind beta's load, which waits
    # for room; its wait counts from its arrival, not from when it gets the loader
    entries = [*entries, ModelEntry(id="delta", source=str(tiny_models["alpha"]))]
    load_wait = 2.0
    with ManagedServer(entries, budget=_budget_for_two(tiny_models), load_wait=load_wait) as srv:
        held = [srv.call(_hold(srv.manager, name)) for name in ("alpha", "gamma")]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(_complete, srv.url, "beta")
            _until(lambda: srv.manager._wanting_room)
            started = time.monotonic()
            second = pool.submit(_complete, srv.url, "delta")
            queued = second.result(60)
            waited = time.monotonic() - started
            assert first.result(60).status_code == 503
        assert queued.status_code == 503 and queued.headers["Retry-After"] == "5"
        assert waited < load_wait + 1.0, waited  # was beta's wait plus its own, ~2x
        error = queued.json()["error"]
        assert error["code"] == "insufficient_memory"
        # its deadline passes behind beta's load or (beta's ended first) waiting for room
        assert error["message"].startswith("model 'delta' "), error
        assert "2s" in error["message"] and error["message"].endswith("retry later")
        for slot in held:
            srv.call(_let_go(srv.manager, slot))
        assert _complete(srv.url, "delta").status_code == 200


def test_clients_switching_among_three_models_with_room_for_two_all_get_200s(tiny_models, entries):
    with ManagedServer(entries, budget=_budget_for_two(tiny_models)) as srv:
        names = list(tiny_models)

        def client(seed: int) -> list[int]:
            pick = random.Random(seed)
            # long enough answers that loads meet busy models (with no wait: ~1 in 6 was 503)
            return [
                _complete(srv.url, pick.choice(names), max_tokens=48).status_code for _ in range(4)
            ]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = [c for got in pool.map(client, range(6)) for c in got]
        assert codes == [200] * len(codes)
        assert srv.manager.used() <= srv.manager.config.budget
