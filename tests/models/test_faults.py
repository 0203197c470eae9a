"""Requests waiting for a loading model are bounded (429 + Retry-After); a crash in one model's
step fails that model's requests only."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx

from llm_server.models.slots import Status
from llm_server.testing.managed import ManagedServer

from .test_on_demand import _complete


def test_requests_waiting_for_a_load_are_bounded(entries):
    with ManagedServer(entries, max_queued=1) as srv:
        assert _complete(srv.url, "alpha").status_code == 200  # loaded before beta's load
        gate = threading.Event()
        make = srv.manager._factory

        def held(entry, path, *more):  # the load of beta waits for the test to let it go
            gate.wait(60)
            return make(entry, path, *more)

        srv.manager._factory = held
        slot = srv.manager.slots["beta"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(_complete, srv.url, "beta")
            while slot.waiting < 1:
                assert not first.done(), first.result().text
                gate.wait(0.01)
            assert slot.status is Status.LOADING
            refused = _complete(srv.url, "beta")
            assert refused.status_code == 429
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            assert _complete(srv.url, "alpha").status_code == 200  # loaded models serve on
            gate.set()
            assert first.result().status_code == 200


def test_a_crash_in_one_models_step_fails_only_its_requests(entries):
    with ManagedServer(entries) as srv:
        good = _complete(srv.url, "alpha").json()["choices"]
        assert _complete(srv.url, "beta").status_code == 200
        engine = srv.manager.slots["beta"].service.engine
        run = engine.run

        def broken(step):
            raise RuntimeError("boom in beta's forward")

        engine.run = broken
        failed = _complete(srv.url, "beta")
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "engine_error"
        health = httpx.get(f"{srv.url}/health", timeout=30).json()
        assert health["models"]["beta"]["last_error"] == "boom in beta's forward"
        assert health["models"]["alpha"]["last_error"] is None
        assert _complete(srv.url, "alpha").json()["choices"] == good
        engine.run = run
        assert _complete(srv.url, "beta").status_code == 200
