"""Soak: a bounded mixed load with dropped streams ends idle, correct and without a leak.

REQUESTS requests from CLIENTS concurrent clients against --concurrent-requests 4
--max-queued 4 on the tiny model: greedy chat and completions (non-streamed and streamed, a
third of the streams dropped at a random point), scoring (echo + logprobs) and json_schema
requests. Every request that was not dropped is answered exactly as it is alone (greedy
outputs, S10; scores within 1e-4, C4) or refused with 429. At the end every row is free,
the queue is empty, and the process RSS is within RSS_MARGIN_MB of its post-warm-up level.
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
from collections import Counter

import httpx
import pytest

from tests.reliability.conftest import assert_wait_healthy

REQUESTS = 300
CLIENTS = 12  # more clients than rows + queue (8), so some requests get 429
ROWS = 4
QUEUE = 4
RSS_MARGIN_MB = 64
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
TOPICS = ["the capital of France", "a cat", "batching", "hello world", "seven eight", "café"]


def _rss_mb() -> float:
    """This process's RSS through the one memory reader (/proc on Linux, psutil or ps on macOS)."""
    from llm_server.benchmark.memory import sample

    return sample(os.getpid()).rss_bytes / (1 << 20)


def _requests(rng: random.Random) -> list[tuple[str, str, dict]]:
    """The distinct requests the load draws from: (kind, path, body)."""
    out = []
    for i, topic in enumerate(TOPICS):
        msgs = [{"role": "user", "content": f"Tell me about {topic}."}]
        out.append(("chat", CHAT, {"messages": msgs, "max_tokens": 6 + 3 * i, "temperature": 0}))
        out.append(
            ("comp", COMP, {"prompt": f"{topic} is", "max_tokens": 20 - 2 * i, "temperature": 0})
        )
        out.append(
            (
                "score",
                COMP,
                {"prompt": f"{topic} and more", "max_tokens": 0, "echo": True, "logprobs": 2},
            )
        )
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    msgs = [{"role": "user", "content": "Describe a thing as JSON."}]
    out.append(
        (
            "schema",
            CHAT,
            {"messages": msgs, "max_tokens": 40, "temperature": 0, "response_format": fmt},
        )
    )
    return out


def _answer(kind: str, body: dict) -> object:
    """What must not change between runs: text, or the scored logprobs."""
    choice = body["choices"][0]
    if kind == "score":
        return choice["logprobs"]["token_logprobs"]
    if kind in ("chat", "schema"):
        return choice["message"]["content"]
    return choice["text"]


def _same(kind: str, got: object, want: object) -> bool:
    if kind != "score":
        return got == want
    return got[0] is None and all(abs(a - b) < 1e-4 for a, b in zip(got[1:], want[1:], strict=True))


def _stream_text(resp: httpx.Response, drop_after: int | None) -> str | None:
    """The streamed text, or None when dropped after `drop_after` events."""
    text = []
    for n, line in enumerate(resp.iter_lines()):
        if drop_after is not None and n >= drop_after:
            return None
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"]
        if choice:
            text.append(choice[0].get("delta", {}).get("content") or choice[0].get("text") or "")
    return "".join(text)


@pytest.fixture(scope="module")
def soak_server(tiny_model_path):
    from llm_server.testing.live import LiveServer, tiny_service

    svc = tiny_service(tiny_model_path, concurrent=ROWS, max_queued=QUEUE)
    srv = LiveServer(svc).start()
    yield srv
    srv.stop()
    svc.scheduler.abort()
    svc.close(30)


def test_soak(soak_server):
    srv = soak_server
    rng = random.Random(1234)
    pool = _requests(rng)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        reference = []
        for kind, path, body in pool:
            resp = c.post(path, json=body)
            assert resp.status_code == 200, resp.text
            reference.append(_answer(kind, resp.json()))
        json.loads(reference[-1])  # the schema request's output parses
        plan = [
            (rng.randrange(len(pool)), rng.random(), rng.randrange(1, 6)) for _ in range(REQUESTS)
        ]

        def client(jobs: list[tuple[int, float, int]], outcomes: Counter, wrong: list) -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as cc:
                for idx, roll, drop_at in jobs:
                    kind, path, body = pool[idx]
                    stream = kind in ("chat", "comp") and roll < 0.5
                    if not stream:
                        resp = cc.post(path, json=body)
                        if resp.status_code == 429:
                            outcomes["429"] += 1
                        elif resp.status_code != 200 or not _same(
                            kind, _answer(kind, resp.json()), reference[idx]
                        ):
                            wrong.append((kind, resp.status_code, resp.text[:200]))
                        else:
                            outcomes["ok"] += 1
                        continue
                    dropped = roll < 0.5 / 3  # a third of the streams
                    with cc.stream("POST", path, json={**body, "stream": True}) as resp:
                        if resp.status_code == 429:
                            resp.read()
                            outcomes["429"] += 1
                            continue
                        text = _stream_text(resp, drop_at if dropped else None)
                    if dropped:
                        outcomes["dropped"] += 1
                    elif resp.status_code != 200 or text != reference[idx]:
                        wrong.append((kind + "-stream", resp.status_code, text))
                    else:
                        outcomes["ok"] += 1

        def run_load(jobs) -> tuple[Counter, list]:
            outcomes: Counter = Counter()
            wrong: list = []
            threads = [
                threading.Thread(target=client, args=(jobs[i::CLIENTS], outcomes, wrong))
                for i in range(CLIENTS)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert not any(t.is_alive() for t in threads)
            return outcomes, wrong

        run_load(plan[: REQUESTS // 4])  # warm-up: same mix, fills allocator and caches
        assert_wait_healthy(c)
        gc.collect()
        rss_warm = _rss_mb()

        outcomes, wrong = run_load(plan)
        assert not wrong, wrong[:5]
        assert sum(outcomes.values()) == REQUESTS
        assert outcomes["ok"] > REQUESTS / 3 and outcomes["dropped"] > 0, outcomes
        assert outcomes["429"] > 0, outcomes  # the refusal path was exercised

        health = assert_wait_healthy(c)
        assert health["last_error"] is None
        assert not srv.service.scorer.pending()
        gc.collect()
        rss_end = _rss_mb()
        print(f"soak: {dict(outcomes)}; RSS warm {rss_warm:.0f} MB, end {rss_end:.0f} MB")
        assert rss_end - rss_warm < RSS_MARGIN_MB, (rss_warm, rss_end)
