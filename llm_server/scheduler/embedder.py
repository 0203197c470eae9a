"""Embedding batches between decode steps, on the engine's embedding session (C1-C4 for vectors).

Inputs queue shortest first and form padded batches by the scorer's rules (a batch stops before
a third of its positions would be padding); one call of `run_batch` runs ONE forward of at most
SCORE_CHUNK positions, so running generations wait at most one chunk. Rows are right-padded
with their last token: attention is causal, so padding never reaches a real position, and
pooling reads real positions only (pooling.PoolAccumulator). Each input's vector therefore
equals embedding it alone, up to float32 rounding.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from llm_server.engines.contract import EmbeddingsUnsupported, Engine
from llm_server.pooling import EmbeddingConfig, PoolAccumulator
from llm_server.scheduler.score_session import (
    TRACE_LIMIT,
    chunk_sizes,
    end_session,
    pad_rows,
    padded_rows,
)
from llm_server.scheduler.scorer import MAX_SCORE_BATCH
from llm_server.scheduler.shortest_first import PumpRequest, ShortestFirstQueue

log = logging.getLogger(__name__)


class EmbeddingError(RuntimeError):
    """An embedding forward failed; every request in that batch gets this error."""


def supports_embeddings(engine: Engine) -> bool:
    """Whether `engine` serves embed_begin/embed_chunk/embed_end (`Engine.no_embeddings`)."""
    return engine.no_embeddings is None


@dataclass(eq=False)
class EmbedRequest(PumpRequest):
    """One embeddings request: all its inputs queue together; `future` gets [n, hidden]."""

    inputs: list[list[int]]
    future: Future = field(default_factory=Future)
    vectors: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0
    started: bool = False

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.inputs)
        self.remaining = len(self.inputs)


@dataclass(frozen=True)
class _Queued:
    request: EmbedRequest
    index: int

    @property
    def tokens(self) -> list[int]:
        return self.request.inputs[self.index]


@dataclass(eq=False)
class _Batch:
    members: list[_Queued]
    tokens: np.ndarray  # [rows, sum(chunks)] int32, rows padded with their last token
    chunks: list[int]  # positions per forward
    pool: PoolAccumulator
    done: int = 0  # chunks run


class Embedder:
    """The scheduler's embedding pump: queues inputs, advances one batch chunk per call."""

    def __init__(
        self,
        config: EmbeddingConfig,
        wake: Callable[[], None] = lambda: None,
        max_batch: int = MAX_SCORE_BATCH,
        max_queued: int = 64,
        retry_after: float = 1.0,
    ) -> None:
        self.config = config
        self.max_batch = max_batch
        self._queue = ShortestFirstQueue(wake, max_queued, retry_after, "embedding")
        self._batch: _Batch | None = None  # owned by the scheduler thread
        # (rows, q) of recent forwards, for tests and diagnostics
        self.forwards: collections.deque[tuple[int, int]] = collections.deque(maxlen=TRACE_LIMIT)

    # -- any thread ------------------------------------------------------------------

    def submit(self, inputs: list[list[int]]) -> EmbedRequest:
        """Queue every input of one request; raises QueueFull/SchedulerClosed."""
        req = EmbedRequest([list(p) for p in inputs])
        self._queue.push(req, [_Queued(req, i) for i in range(len(req.inputs))])
        return req

    def pending(self) -> bool:
        return self._batch is not None or bool(self._queue)

    def close(self) -> None:
        """Refuse new requests and fail the queued ones."""
        for item in self._queue.close():
            item.request.fail(self._queue.closed_error())

    # -- the scheduler thread --------------------------------------------------------

    def run_batch(self, engine: Engine) -> None:
        """Advance embedding by ONE forward: open a batch if none is open, run its next chunk."""
        batch = self._batch or self._open(engine)
        if batch is None:
            return
        try:
            lo = sum(batch.chunks[: batch.done])
            q = batch.chunks[batch.done]
            self.forwards.append((batch.tokens.shape[0], q))
            hidden = engine.embed_chunk(batch.tokens[:, lo : lo + q])  # [rows, q, hidden]
            batch.pool.add(hidden[: len(batch.members)])  # padded rows are never read
            batch.done += 1
        except Exception as exc:  # noqa: BLE001 - fails this batch's requests only
            self._close_batch(engine)
            self._fail_batch(batch, exc)
            return
        if batch.done == len(batch.chunks):
            self._close_batch(engine)
            self._deliver(batch)

    def _open(self, engine: Engine) -> _Batch | None:
        cap = self.max_batch if engine.dynamic_shapes else min(self.max_batch, engine.rows)
        members = [m for m in self._queue.take(cap) if m.request.claim()]
        if not members:
            return None
        if not supports_embeddings(engine):
            exc = EmbeddingError(f"the {engine.name} engine does not compute embeddings")
            for m in members:
                m.request.fail(exc)
            return None
        pad = engine.padded_shapes
        rows = padded_rows(len(members), cap, engine.dynamic_shapes and pad)
        lengths = [len(m.tokens) for m in members]
        chunks = chunk_sizes(max(lengths), engine.context_length, buckets=pad)
        tokens = pad_rows([m.tokens for m in members], rows, sum(chunks))
        batch = _Batch(members, tokens, chunks, PoolAccumulator(self.config.pooling, lengths))
        try:
            engine.embed_begin(rows)
        except Exception as exc:  # noqa: BLE001 - must not escape into the scheduler loop
            self._fail_batch(batch, exc)
            return None
        self._batch = batch
        return batch

    def _close_batch(self, engine: Engine) -> None:
        self._batch = None
        end_session(engine.embed_end)

    def _deliver(self, batch: _Batch) -> None:
        vectors = batch.pool.finish(self.config.normalize)  # [n, hidden]
        for row, m in enumerate(batch.members):
            req = m.request
            if req.abandoned:
                continue
            req.vectors[m.index] = vectors[row]
            req.remaining -= 1
            if req.remaining == 0:
                req.future.set_result(np.stack(req.vectors))

    def _fail_batch(self, batch: _Batch, exc: Exception) -> None:
        log.error("embedding batch failed: %s", exc)
        if isinstance(exc, EmbeddingError | EmbeddingsUnsupported):
            err = exc  # EmbeddingsUnsupported: the model cannot embed at all (HTTP 400)
        else:
            err = EmbeddingError(f"embedding failed: {exc}")
        for m in batch.members:
            m.request.fail(err)
