"""Two ranks on localhost (ring backend, CPU) serving the tiny checkpoint tensor-parallel."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llm_server.testing.ranks import start_ranks
from tests.distributed.helpers import assert_answers_as_one_process, model_id


@pytest.fixture(scope="module")
def ranks(tiny_model_path, tmp_path_factory):
    group = start_ranks(tiny_model_path, tmp_path_factory.mktemp("ranks"), 2)
    yield group
    group.stop()


def test_two_ranks_answer_as_one_process(ranks, live_server, tiny_model_path):
    alone = live_server(tiny_model_path, concurrent=4)
    health = assert_answers_as_one_process(ranks.url, alone.url)
    assert health["distributed"]["backend"] == "ring"
    assert health["distributed"]["mode"] == "tensor"
    assert health["distributed"]["ranks"] == 2
    assert health["distributed"]["steps"] > 0 and health["distributed"]["lost"] is None


def test_embeddings_are_refused_on_a_sharded_model(ranks):
    r = httpx.post(
        ranks.url + "/v1/embeddings", json={"model": model_id(ranks.url), "input": "hi"}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert "sharded" in r.json()["error"]["message"]


def test_a_dead_rank_gets_503_and_rank_zero_exits(tiny_model_path, tmp_path):
    group = start_ranks(tiny_model_path, tmp_path, 2, ("--distributed-timeout", "5"))
    try:
        client = httpx.Client(base_url=group.url, timeout=60)
        body = {
            "model": model_id(group.url),
            "prompt": "Hello",
            "max_tokens": 1000,
            "temperature": 0,
        }
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(client.post, "/v1/completions", json=body)
            while client.get("/health").json()["rows_busy"] == 0 and not running.done():
                time.sleep(0.02)
            group.procs[1].kill()
            try:
                answer = running.result()
            except httpx.TransportError as exc:
                pytest.fail(f"no answer to the running request ({exc}):\n{group.text()}")
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "group_lost"
        assert "the distributed group was lost" in answer.json()["error"]["message"]
        try:
            after = client.post("/v1/completions", json=body).status_code
        except httpx.TransportError:
            after = None  # already gone
        assert after in (503, None)
        assert group.procs[0].wait(30) == 3, group.text()
    finally:
        group.stop()


def test_sigterm_on_rank_zero_stops_every_rank(ranks):
    """Last in the file: it ends the module's group (saves starting another)."""
    ranks.procs[0].terminate()
    codes = [p.wait(30) for p in ranks.procs]
    assert codes == [0, 0], ranks.text()
