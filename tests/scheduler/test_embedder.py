"""Embedding batches between decode steps, on the tiny llama: reference vectors, batch == alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from llm_server.decoding import SamplingParams
from llm_server.engines.contract import SCORE_CHUNK, EngineError
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.pooling import EmbeddingConfig, Pooling
from llm_server.scheduler import FinishEvent, TokenEvent
from llm_server.scheduler.embedder import Embedder, EmbeddingError
from llm_server.scheduler.pumps import Pumps
from tests.embedding_reference import ReferenceLlama

BATCH_TOL = 1e-5  # a vector in a padded batch vs the same input alone (float32 rounding)
REF_TOL = 1e-5  # our engine vs the float64 numpy reference, unit vectors


@pytest.fixture(scope="module")
def engine(tiny_llama_path) -> MLXEngine:
    return MLXEngine(tiny_llama_path)


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> ReferenceLlama:
    return ReferenceLlama(tiny_llama_path)


def inputs_of(lengths: list[int], seed: int, vocab: int = 300) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n in lengths]


def embed_now(embedder: Embedder, engine, inputs: list[list[int]]) -> np.ndarray:
    req = embedder.submit(inputs)
    while embedder.pending():
        embedder.run_batch(engine)
    return req.future.result(0)


@pytest.mark.parametrize("mode", list(Pooling))
def test_vectors_match_the_numpy_reference_and_embedding_alone(engine, reference, mode):
    cfg = EmbeddingConfig(mode, normalize=True)
    embedder = Embedder(cfg)
    inputs = inputs_of([1, 6, 40, 127, 128, 129, 300], seed=1)
    batched = embed_now(embedder, engine, inputs)
    assert batched.shape == (len(inputs), 64) and batched.dtype == np.float32
    assert max(q for _, q in embedder.forwards) <= SCORE_CHUNK  # long inputs ran in chunks
    assert any(rows > 1 for rows, _ in embedder.forwards)  # and some inputs shared a batch
    for ids, vec in zip(inputs, batched, strict=True):
        alone = embed_now(embedder, engine, [ids])[0]
        np.testing.assert_allclose(vec, alone, rtol=0, atol=BATCH_TOL)
        want = reference.embed(ids, mode.value, normalize=True)
        np.testing.assert_allclose(vec, want, rtol=0, atol=REF_TOL)


def test_unnormalised_mean_is_the_raw_mean(engine, reference):
    ids = inputs_of([70], seed=2)[0]
    got = embed_now(Embedder(EmbeddingConfig(Pooling.MEAN, normalize=False)), engine, [ids])[0]
    np.testing.assert_allclose(got, reference.embed(ids, "mean", False), rtol=1e-4, atol=1e-5)
    assert abs(np.linalg.norm(got) - 1) > 0.01


class RecordingEngine:
    """A real engine that logs decode and embedding forwards, and can fail on a token."""

    def __init__(self, inner: MLXEngine, poison: int | None = None) -> None:
        self._inner = inner
        self.poison = poison
        self.events: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def decode(self, rows, tokens):
        self.events.append("decode")
        return self._inner.decode(rows, tokens)

    def run(self, plan):  # the scheduler's step: decode rows (and prompt chunks) in one forward
        if plan.decode:
            self.events.append("decode")
        return self._inner.run(plan)

    def decode_start(self, rows, tokens):
        self.events.append("decode")
        return self._inner.decode_start(rows, tokens)

    def embed_chunk(self, tokens):
        self.events.append("embed")
        if self.poison is not None and (tokens == self.poison).any():
            raise EngineError("poisoned token in the batch")
        return self._inner.embed_chunk(tokens)


async def generate(svc, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = []
    async for ev in svc.start_generation(prompt, params).events():
        if isinstance(ev, TokenEvent):
            tokens.append(ev.token_id)
        elif isinstance(ev, FinishEvent):
            assert ev.error is None
    return tokens


def test_embeddings_run_between_decode_steps_without_changing_chat(
    tiny_llama_path, make_service, engine
):
    recorder: list[RecordingEngine] = []

    def factory():
        recorder.append(RecordingEngine(MLXEngine(tiny_llama_path, EngineSettings(rows=3))))
        return recorder[0]

    svc = make_service(tiny_llama_path, 3, engine_factory=factory)
    assert isinstance(svc.scheduler.pump, Pumps)
    chats = [svc.tokenizer.encode(t) for t in ("The capital of France", "Hello, how are")]
    sets = [inputs_of([300, 5, 260], seed=3), inputs_of([129, 2], seed=4)]

    async def together():
        gens = [asyncio.ensure_future(generate(svc, c, 40)) for c in chats]
        await asyncio.sleep(0)
        vecs = [asyncio.ensure_future(svc.embed(s)) for s in sets]
        return await asyncio.gather(*gens), await asyncio.gather(*vecs)

    async def alone_first():
        return [await generate(svc, c, 40) for c in chats]

    alone = asyncio.run(alone_first())
    events = recorder[0].events
    events.clear()
    gens, vecs = asyncio.run(together())
    assert gens == alone  # chat output is token-identical with embeddings in between
    decodes = [i for i, e in enumerate(events) if e == "decode"]
    assert events.count("embed") >= 4  # the long inputs took several chunks
    between = [
        events[lo + 1 : hi].count("embed") for lo, hi in zip(decodes, decodes[1:], strict=False)
    ]
    assert max(between) <= 1  # decoding waits one embedding chunk at most
    assert sum(between) >= 2  # embeddings really ran while the chats were decoding
    embedder = Embedder(svc.embedding)
    for inputs, got in zip(sets, vecs, strict=True):
        np.testing.assert_allclose(got, embed_now(embedder, engine, inputs), atol=BATCH_TOL)


def test_engine_error_fails_only_that_batch(tiny_llama_path):
    inner = MLXEngine(tiny_llama_path)
    eng = RecordingEngine(inner, poison=7)
    embedder = Embedder(EmbeddingConfig(Pooling.LAST, True))
    bad = embedder.submit([[1, 2, 7, 3]])
    while embedder.pending():
        embedder.run_batch(eng)
    good = embedder.submit([[1, 2, 3, 4]])
    while embedder.pending():
        embedder.run_batch(eng)
    with pytest.raises(EmbeddingError, match="poisoned"):
        bad.future.result(0)
    assert good.future.result(0).shape == (1, 64)


def test_an_engine_without_embeddings_fails_cleanly(engine):
    class NoEmbed:
        name, rows, dynamic_shapes, padded_shapes, context_length = "coreml", 1, False, True, 64
        no_embeddings = "the coreml engine does not compute embeddings"

    embedder = Embedder(EmbeddingConfig(Pooling.LAST, True))
    req = embedder.submit([[1, 2, 3]])
    embedder.run_batch(NoEmbed())
    with pytest.raises(EmbeddingError, match="coreml engine does not compute embeddings"):
        req.future.result(0)
    assert not embedder.pending()
