"""Engine faults over HTTP: a failing forward fails only its own request (S8), no stack trace
leaks, the scheduler keeps serving and /health reports the last error."""

from __future__ import annotations

import threading
import time

import httpx

from llm_server.engines.settings import EngineSettings
from tests.api.helpers import assert_openai_error
from tests.reliability.conftest import assert_healthy
from tests.scheduler.helpers import PoisonEngine

DECODE_POISON = 13  # a prompt starting with this id fails every decode forward it is part of
PREFILL_POISON = 17  # a prompt starting with this id runs out of memory in its prefill


class FaultyEngine(PoisonEngine):
    POISON = DECODE_POISON
    MESSAGE = "simulated failure in /secret/path/forward.py"

    def prefill(self, row, tokens):
        if tokens[0] == PREFILL_POISON:
            raise MemoryError("simulated out-of-memory in /secret/path/prefill.py")
        return super().prefill(row, tokens)

    def run(self, plan):  # prompts run as chunks of step plans
        if any(c.fresh and c.prompt[0] == PREFILL_POISON for c in plan.prefill):
            raise MemoryError("simulated out-of-memory in /secret/path/prefill.py")
        return super().run(plan)


def _body(first: int, stream: bool = False) -> dict:
    return {"prompt": [first, 40, 41, 42], "max_tokens": 12, "temperature": 0, "stream": stream}


def test_faulty_forward_fails_only_its_request(live_server, tiny_model_path):
    srv = live_server(
        tiny_model_path,
        concurrent=4,
        engine_factory=lambda: FaultyEngine(tiny_model_path, EngineSettings(rows=4)),
    )
    good_firsts = [20, 21, 22]
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        expected = {
            f: c.post("/v1/completions", json=_body(f)).json()["choices"][0]["text"]
            for f in good_firsts
        }
        assert srv.service.scheduler.stats().last_error is None

        sched = srv.service.scheduler
        results: dict[str, httpx.Response] = {}

        def send(key: str, body: dict) -> None:
            with httpx.Client(base_url=srv.url, timeout=60) as cc:
                results[key] = cc.post("/v1/completions", json=body)

        bodies = {f"good{f}": _body(f) for f in good_firsts}
        bodies["decode_poison"] = _body(DECODE_POISON)
        bodies["prefill_oom"] = _body(PREFILL_POISON)
        lease = sched.acquire_lease(30)  # pause so every request lands in the same batch
        threads = [threading.Thread(target=send, args=kv) for kv in bodies.items()]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while sched.stats().queued < len(bodies):
                assert time.monotonic() < deadline, sched.stats()
                time.sleep(0.01)
        finally:
            lease.release()
        for t in threads:
            t.join(60)

        for key in ("decode_poison", "prefill_oom"):
            resp = results[key]
            err = assert_openai_error(resp, 500)
            assert err["code"] == "engine_error" and "failed" in err["message"]
            assert "secret" not in resp.text and "Traceback" not in resp.text
        for f in good_firsts:
            resp = results[f"good{f}"]
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == expected[f]

        # A streamed request was admitted before its 200 started: the error arrives in the stream.
        with c.stream("POST", "/v1/completions", json=_body(DECODE_POISON, stream=True)) as resp:
            assert resp.status_code == 200
            text = "".join(resp.iter_text())
        assert '"type": "server_error"' in text and "secret" not in text

        health = assert_healthy(c)
        assert "simulated" in health["last_error"]
        # and it keeps serving
        again = c.post("/v1/completions", json=_body(20))
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected[20]
