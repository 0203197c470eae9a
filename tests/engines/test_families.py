"""Every architecture family on tiny random checkpoints built with mlx-lm's own classes.

Per batching family: 4 greedy rows started at different decode steps (prompts of 3..29 tokens,
past the 8-position sliding windows) equal each row served alone, and alone equals mlx-lm's
own greedy generation on the same folder. The serial family (llama4: chunked attention, which
mlx-lm masks from the cache's own offset) serves through a live server with exactly one warning
naming why, and answers what mlx-lm answers.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading

import numpy as np
import openai
import pytest

from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler.scorer import Scorer
from llm_server.testing.families import FAMILIES, WINDOW
from llm_server.testing.live import serving
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import make_request, serve_alone, start_scheduler

SERIAL = "llama4"
BATCHED = [f for f in FAMILIES if f != SERIAL]
LENGTHS = (3, 11, 20, 29)
NEW = 8


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 380, n)] for n in LENGTHS]


def mlx_lm_greedy(path, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own greedy generation (its model, its caches, its sampler)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = load(str(path))
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=make_sampler(0.0))
    return [int(t) for t, _ in steps]


def alone(path, prompt: list[int], n: int) -> list[int]:
    engine = MLXEngine(path, EngineSettings(rows=1))
    logits, out = engine.prefill(0, prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.decode([0], [out[-1]])[0]
    return out


def staggered(engine: MLXEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Row i is prefilled after 2*i batched decode steps of the rows before it."""
    out: list[list[int]] = [[] for _ in prompts]

    def step() -> None:
        rows = [r for r in range(len(prompts)) if out[r] and len(out[r]) < n]
        if rows:
            logits = engine.decode(rows, [out[r][-1] for r in rows])
            for r, lg in zip(rows, logits, strict=True):
                out[r].append(int(np.argmax(lg)))

    for row, prompt in enumerate(prompts):
        out[row].append(int(np.argmax(engine.prefill(row, prompt))))
        for _ in range(2):
            step()
    while any(len(o) < n for o in out):
        step()
    return out


@pytest.mark.parametrize("family", BATCHED)
def test_family_batches_exactly_and_matches_mlx_lm(family, checkpoint, prompts):
    path = checkpoint(family)
    engine = MLXEngine(path, EngineSettings(rows=4))
    assert engine.serial_reason is None and engine.rows == 4
    expected = [alone(path, p, NEW) for p in prompts]
    assert staggered(engine, prompts, NEW) == expected
    # alone is what mlx-lm itself generates (correct, not only self-consistent)
    assert [mlx_lm_greedy(path, p, NEW) for p in prompts] == expected


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "gpt_oss"])
def test_sliding_window_takes_effect(family, checkpoint, prompts, tmp_path):
    """The same weights without the window answer the longest prompt differently."""
    path = checkpoint(family)
    wide = tmp_path / "wide"
    shutil.copytree(path, wide)
    config = json.loads((wide / "config.json").read_text())
    config["sliding_window"] = 4096
    (wide / "config.json").write_text(json.dumps(config))
    windowed = MLXEngine(path, EngineSettings(rows=1))
    assert any(c.window == WINDOW for c in windowed.layout.layers)
    assert alone(path, prompts[-1], NEW) != alone(wide, prompts[-1], NEW)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next", "gpt_oss"])
def test_scheduler_batches_staggered_requests(family, checkpoint, prompts):
    """Through the real BatchScheduler, pipelined as on Metal (a model with recurrent state
    turns pipelining off): a request joins when the one before has a token."""
    path = checkpoint(family)
    tok = Tokenizer(path)
    solo = [serve_alone(path, tok, p, NEW, ignore_eos=True).tokens for p in prompts]
    sched = start_scheduler(path, 4, pipeline=True)
    assert sched.engine.pipelined == (family != "qwen3_next")
    try:
        outs = []
        for p in prompts:
            req, out = make_request(tok, p, NEW, ignore_eos=True)
            sched.submit(req)
            outs.append(out)
            out.wait_first_token()
        assert all(o.done.wait(60) for o in outs)
        assert sched.max_rows_busy > 1  # they did share decode steps
        assert [o.tokens for o in outs] == solo
    finally:
        sched.close(10)


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_serial_family_warns_once_and_answers_as_mlx_lm(checkpoint, prompts):
    path = checkpoint(SERIAL)
    counter = _Count()
    logging.getLogger("llm_server").addHandler(counter)
    try:
        with serving(path, concurrent=4) as server:
            assert server.service.engine.rows == 1 and not server.service.batching
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            answers: dict[int, object] = {}

            def ask(i: int) -> None:
                answers[i] = client.completions.create(
                    model=server.state.model_id,
                    prompt=prompts[i],
                    max_tokens=NEW,
                    temperature=0,
                )

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            tok = server.service.tokenizer
    finally:
        logging.getLogger("llm_server").removeHandler(counter)
    warnings = [line for line in counter.lines if "at a time" in line]
    assert len(warnings) == 1, counter.lines
    assert warnings[0] == (
        "serving 1 request(s) at a time instead of 4: llama4: its layers keep ChunkedKVCache "
        "caches, which the row cache cannot hold per request"
    )
    for i, p in enumerate(prompts):
        choice = answers[i].choices[0]
        expected = mlx_lm_greedy(path, p, NEW)
        ends = [j for j, t in enumerate(expected) if t in tok.eos_token_ids]
        assert choice.text == tok.decode(expected[: ends[0] if ends else NEW])
        assert choice.finish_reason == ("stop" if ends else "length")


@pytest.mark.parametrize("family", [*BATCHED, SERIAL])
def test_scoring_session_in_chunks_equals_one_forward(family, checkpoint, prompts):
    """Two rows scored in chunks of 7 positions (past the windows, across recurrent state)
    give the log-probabilities of mlx-lm's single forward over the whole sequence."""
    engine = MLXEngine(checkpoint(family), EngineSettings(rows=2))
    tokens = np.array([prompts[2], prompts[3][:20]], dtype=np.int32)  # [2, 20]
    targets = np.roll(tokens, -1, axis=1)
    logits = engine.all_position_logits(tokens).astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    engine.score_begin(2)
    got = [engine.score_chunk(tokens[:, i : i + 7], targets[:, i : i + 7], 0) for i in (0, 7, 14)]
    engine.score_end()
    assert np.abs(np.concatenate([g.token_logprobs for g in got], axis=1) - expected).max() < 1e-3


@pytest.mark.parametrize("family", ["gemma3_text", "lfm2"])
def test_prefix_cache_reuse_only_where_the_state_allows(family, checkpoint, prompts):
    """A windowed model reuses a released row's prefix (full KV kept); a recurrent one cannot
    rewind its state, so it resumes from the state checkpoint at its prompt's end (kv/rows.py).
    Either way the answer is the fresh one."""
    path = checkpoint(family)
    first, longer = prompts[3], prompts[3] + prompts[1]
    expected = alone(path, longer, NEW)
    engine = MLXEngine(path, EngineSettings(rows=2))
    logits = engine.prefill(0, first)
    for _ in range(3):
        logits = engine.decode([0], [int(np.argmax(logits))])[0]
    engine.release(0)  # its history goes to the prefix cache where there is one
    logits, got = engine.prefill(1, longer), []
    for _ in range(NEW):
        got.append(int(np.argmax(logits)))
        logits = engine.decode([1], [got[-1]])[0]
    assert got == expected
    assert engine.cached_tokens(1) == len(first)


def _llama_module(name: str, attention: type):
    """An mlx-lm model module `mlx_lm.models.<name>`: llama's classes with every layer's
    attention an `attention` instance."""
    import types

    from mlx_lm.models import llama

    class Model(llama.Model):
        def __init__(self, args):
            super().__init__(args)
            for layer in self.model.layers:
                layer.self_attn = attention(args)

    module = types.ModuleType(f"mlx_lm.models.{name}")
    module.Model, module.ModelArgs = Model, llama.ModelArgs
    return module


def _offset_after_update_module():
    """An mlx-lm-style model module (llama's classes) whose attention reads `cache.offset`
    after `update_and_fetch`, relying on mlx-lm's KVCache having advanced it: a cache
    protocol the row views do not follow."""
    from mlx_lm.models import llama

    class Attention(llama.Attention):
        def __call__(self, x, mask=None, cache=None):
            b, n, _ = x.shape
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
            k = k.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = v.reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            k, v = cache.update_and_fetch(self.rope(k, offset=cache.offset), v)
            q = self.rope(q, offset=cache.offset - n)
            out = llama.scaled_dot_product_attention(q, k, v, cache, scale=self.scale, mask=mask)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    return _llama_module("offset_after_update", Attention)


def test_unverified_architecture_that_differs_is_served_serially(
    checkpoint, prompts, tmp_path, monkeypatch
):
    """The load-time check catches a forward the row views get wrong: one row, the reason,
    and mlx-lm's answers (cohere2, unverified but correct, batches: see the tests above)."""
    import sys

    monkeypatch.setitem(
        sys.modules, "mlx_lm.models.offset_after_update", _offset_after_update_module()
    )
    path = tmp_path / "probe"
    shutil.copytree(checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "offset_after_update"}))
    engine = MLXEngine(path, EngineSettings(rows=4))
    assert engine.rows == 1  # serves one request at a time
    assert engine.serial_reason == (
        "offset_after_update: its forward over per-row caches differs from mlx-lm's own"
    )
    assert engine.prefix_cache.max_bytes == 0 and engine.cursor(0) == 0
    for p in prompts[2:]:
        logits, got = engine.prefill(0, p), []
        for _ in range(NEW):
            got.append(int(np.argmax(logits)))
            logits = engine.decode([0], [got[-1]])[0]
        engine.release(0)
        assert got == mlx_lm_greedy(path, p, NEW)
    assert MLXEngine(checkpoint("cohere2"), EngineSettings(rows=4)).serial_reason is None


@pytest.mark.parametrize(
    ("family", "rows"),
    [("llama", 8), ("mistral", 8), ("gemma3_text", 0), ("qwen3_next", 8), (SERIAL, 0)],
)
def test_scoring_rows_only_where_the_row_store_can_hold_them(family, rows, checkpoint):
    """Scoring rides in the step plans on the store's scoring rows for plain heads (fused or
    not, sliding windows included) and hybrids (their own head over every position, the state
    slot cleared per prompt); a head only mlx-lm can run on other models and a serial model
    keep the separate scoring session, chosen once by Scorer.attach."""
    engine = MLXEngine(checkpoint(family), EngineSettings(rows=2))
    assert engine.score_rows == rows
    scorer = Scorer()
    assert scorer.attach(engine) is (rows > 0)
    assert scorer.session.enabled is (rows == 0)


def _asks_cache_size_module():
    """An mlx-lm-style model module (llama's classes) whose attention calls `cache.size()`,
    which mlx-lm's KVCache has and the row views do not: a forward that raises over them."""
    from mlx_lm.models import llama

    class Attention(llama.Attention):
        def __call__(self, x, mask=None, cache=None):
            if cache is not None and cache.size() < 0:
                raise AssertionError("unreachable: a size is never negative")
            return super().__call__(x, mask=mask, cache=cache)

    return _llama_module("asks_cache_size", Attention)


def test_unverified_architecture_whose_forward_fails_is_served_serially(
    checkpoint, prompts, tmp_path, monkeypatch
):
    """A forward that raises over the row views at the load-time check: one row, the reason
    naming the error, and mlx-lm's answers on its own caches (never a failing request)."""
    import sys

    monkeypatch.setitem(sys.modules, "mlx_lm.models.asks_cache_size", _asks_cache_size_module())
    path = tmp_path / "probe"
    shutil.copytree(checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "asks_cache_size"}))
    engine = MLXEngine(path, EngineSettings(rows=4))
    assert engine.rows == 1
    assert engine.serial_reason == (
        "asks_cache_size: its forward over per-row caches fails (EngineError: forward failed: "
        "'RowView' object has no attribute 'size')"
    )
    for p in prompts[2:]:
        logits, got = engine.prefill(0, p), []
        for _ in range(NEW):
            got.append(int(np.argmax(logits)))
            logits = engine.decode([0], [got[-1]])[0]
        engine.release(0)
        assert got == mlx_lm_greedy(path, p, NEW)
