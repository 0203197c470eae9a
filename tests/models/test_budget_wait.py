"""A request whose prompt's KV the memory budget refuses waits for room (queued, holding no
row) instead of failing at once: it runs once a row is freed, and gets the budget's 503 with
Retry-After only past its bound (the service's `memory_wait`)."""

from __future__ import annotations

import threading
import time

import pytest
from tokenizers import Tokenizer

from llm_server.models.memory import estimate_size
from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

from .test_budget import POSITION, _ask, _prompt


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory):
    """test_budget.py's: a tiny model whose rows reach 8192 positions."""
    root = tmp_path_factory.mktemp("long")
    spec = TinySpec(arch="qwen3", seed=4, max_position_embeddings=8192)
    return build_tiny_checkpoint(root / "long", spec)


def _other_prompt(path, tokens: int) -> str:
    """A prompt of exactly `tokens` tokens sharing no prefix with `_prompt`'s."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode("a dog ran in the park with " * tokens).ids[:tokens]
    text = tok.decode(ids)
    assert len(tok.encode(text).ids) == tokens
    return text


def _server(model, wait: float) -> ManagedServer:
    """Two rows, and room beside the weights for one row of 3400 positions, not two of 2000."""
    budget = estimate_size(model, 1, 8192).weights + 3400 * POSITION
    entries = [ModelEntry(id="long", source=str(model), context_length=8192)]
    return ManagedServer(entries, budget=budget, concurrent=2, settings={"memory_wait": wait})


def _in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_two_long_requests_that_fit_one_at_a_time_both_succeed(long_model):
    with _server(long_model, wait=60.0) as srv:
        first, second = _prompt(long_model, 2000), _other_prompt(long_model, 2000)
        a, got_a = _in_thread(lambda: _ask(srv.url, "long", first, max_tokens=200))
        b, got_b = _in_thread(lambda: _ask(srv.url, "long", second, max_tokens=20))
        a.join(120)
        b.join(120)
        assert got_a[0].status_code == 200 and got_b[0].status_code == 200
        scheduler = srv.manager.slots["long"].service.scheduler
        assert scheduler.memory_waits >= 1  # one of them waited for the other's room
        assert scheduler.stats().rows_busy == 0 and scheduler.stats().queued == 0
        assert srv.manager.used() <= srv.manager.budget.limit
        # the rows went back: two more in turn still run
        assert _ask(srv.url, "long", second, max_tokens=4).status_code == 200
        assert _ask(srv.url, "long", "the cat").status_code == 200


def test_past_its_wait_a_request_refused_room_gets_the_503(long_model):
    with _server(long_model, wait=0.3) as srv:
        assert _ask(srv.url, "long", "the cat").status_code == 200  # loaded
        scheduler = srv.manager.slots["long"].service.scheduler
        scheduler.add_step_listener(lambda s, r: time.sleep(0.02))  # the first runs a while
        first = _prompt(long_model, 2000)  # within the store it opens (2560 positions)
        a, got_a = _in_thread(lambda: _ask(srv.url, "long", first, max_tokens=500))
        deadline = time.monotonic() + 60
        while scheduler.stats().rows_busy == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        refused = _ask(srv.url, "long", _other_prompt(long_model, 2000), max_tokens=20)
        waited = time.monotonic() - t0
        assert not got_a  # refused while the first still ran
        a.join(120)
        assert got_a[0].status_code == 200
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        error = refused.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert error["message"].startswith("memory budget: the KV store's growth of model 'long'")
        assert waited >= 0.3 and scheduler.memory_waits >= 1
        assert scheduler.stats().rows_busy == 0 and scheduler.stats().queued == 0
        assert _ask(srv.url, "long", first, max_tokens=4).status_code == 200
