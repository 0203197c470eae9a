"""The scoring fallback: padded batches on the engine's separate scoring session (C2-C4).

For engines whose row store holds no scoring rows (`Engine.score_rows` 0: Core ML, recurrent
state families, serial and sharded engines; scorer.py chooses, in `Scorer.attach`). When no
batch is open, `run_batch` takes queued prompts shortest first and stops before a third of the
batch's positions would be padding (C2); each call then runs ONE forward of up to 128 positions
on the session (C3), so decoding waits at most one scoring forward between two steps; the last
chunk pads to a bucket of 16/32/64/128 positions, never past the context (C4).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llm_server.engines.contract import SCORE_BUCKETS, SCORE_CHUNK, Engine, ScoreChunkResult

log = logging.getLogger(__name__)

TRACE_LIMIT = 4096  # scoring forwards remembered for tests and diagnostics


@dataclass(frozen=True)
class ScoreForward:
    """One scoring forward as it ran (the trace tests read)."""

    batch: int  # sequence number of the scoring batch
    rows: int  # rows fed to the engine (after power-of-two rounding)
    q: int  # positions in this forward
    offset: int  # scoring-session cursor before this forward
    lengths: tuple[int, ...]  # real prompt lengths of the batch, in row order
    requests: tuple[int, ...]  # ScoreRequest.seq of each real row


@dataclass(eq=False)
class _Batch:
    """An open scoring batch: padded inputs plus the per-chunk results gathered so far."""

    seq: int
    members: list
    tokens: np.ndarray  # [rows, length] int32, each row padded with its last token
    targets: np.ndarray  # [rows, length] int32, the next token per position
    chunks: list[int]  # positions per forward
    top_k: int  # k asked of the engine (max over members)
    offset: int = 0
    done: list[ScoreChunkResult] = field(default_factory=list)


def chunk_sizes(length: int, context_length: int, buckets: bool = True) -> list[int]:
    """Positions per forward for a batch `length` long (C3, C4).

    Full chunks of SCORE_CHUNK, then the rest padded up to a bucket (when the engine wants
    padded shapes), never past the context.
    """
    sizes, offset = [], 0
    while length - offset > SCORE_CHUNK:
        sizes.append(SCORE_CHUNK)
        offset += SCORE_CHUNK
    rest = length - offset
    bucket = next(b for b in SCORE_BUCKETS if b >= rest) if buckets else rest
    sizes.append(min(bucket, context_length - offset))
    return sizes


def padded_rows(n: int, max_rows: int, dynamic_shapes: bool) -> int:
    """Rows to feed: a power of two on a dynamic-shape graph (fewer distinct shapes), capped."""
    if not dynamic_shapes:
        return n
    return min(1 << (n - 1).bit_length(), max_rows)


class SessionScoring:
    """The pump face of the scorer on the fallback path: one session forward per call."""

    def __init__(
        self,
        take: Callable[[int], list],
        top_k: Callable[[object], int],
        finish: Callable[[object, ScoreChunkResult], None],
        fail: Callable[[Sequence, Exception], None],
        max_batch: int,
    ) -> None:
        self._take = take  # cap -> claimed members, shortest first (C2)
        self._top_k = top_k  # member -> k asked of the engine
        self._finish = finish  # member, its results [1, T] -> delivered
        self._fail = fail  # members, error -> their requests failed
        self.max_batch = max_batch
        self.enabled = True  # False while the engine's row store scores (Scorer.attach)
        self.has_queued: Callable[[], bool] = lambda: False
        self._batch: _Batch | None = None  # owned by the scheduler thread
        self._batch_seqs = itertools.count(1)
        self.trace: collections.deque[ScoreForward] = collections.deque(maxlen=TRACE_LIMIT)

    def pending(self) -> bool:
        return self._batch is not None or (self.enabled and self.has_queued())

    def run_batch(self, engine: Engine) -> None:
        """Advance scoring by ONE forward: open a batch if none is open, run its next chunk."""
        batch = self._batch
        if batch is None:
            batch = self._open(engine)
            if batch is None:
                return
        try:
            self._forward(engine, batch)
        except Exception as exc:  # noqa: BLE001 - fails this batch's requests only
            self._close(engine)
            log.error("scoring batch %d failed: %s", batch.seq, exc)
            self._fail(batch.members, exc)
            return
        if batch.offset >= batch.tokens.shape[1]:
            self._close(engine)
            self._deliver(batch)

    def _open(self, engine: Engine) -> _Batch | None:
        """Take the next batch off the queue (C2) and open a scoring session for it."""
        cap = self.max_batch if engine.dynamic_shapes else min(self.max_batch, engine.rows)
        members = self._take(cap)
        if not members:
            return None
        pad = engine.padded_shapes
        rows = padded_rows(len(members), cap, engine.dynamic_shapes and pad)
        longest = max(len(m.tokens) for m in members)
        chunks = chunk_sizes(longest, engine.context_length, buckets=pad)
        tokens = pad_rows([m.tokens for m in members], rows, max(longest, sum(chunks)))
        batch = _Batch(
            seq=next(self._batch_seqs),
            members=members,
            tokens=tokens,
            targets=np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1),
            chunks=chunks,
            top_k=min(max(self._top_k(m) for m in members), engine.vocab_size),
        )
        try:
            engine.score_begin(rows)
        except Exception as exc:  # noqa: BLE001 - must not escape into the scheduler loop
            log.error("scoring batch %d failed: %s", batch.seq, exc)
            self._fail(members, exc)
            return None
        self._batch = batch
        return batch

    def _forward(self, engine: Engine, batch: _Batch) -> None:
        q = batch.chunks[len(batch.done)]
        lo, hi = batch.offset, batch.offset + q
        self.trace.append(
            ScoreForward(
                batch=batch.seq,
                rows=batch.tokens.shape[0],
                q=q,
                offset=lo,
                lengths=tuple(len(m.tokens) for m in batch.members),
                requests=tuple(m.request.seq for m in batch.members),
            )
        )
        result = engine.score_chunk(batch.tokens[:, lo:hi], batch.targets[:, lo:hi], batch.top_k)
        batch.done.append(result)
        batch.offset = hi

    def _close(self, engine: Engine) -> None:
        self._batch = None
        end_session(engine.score_end)

    def _deliver(self, batch: _Batch) -> None:
        """Each real row's results over the whole batch (padded rows are never read)."""
        whole = join_chunks(batch.done)  # [rows, T]
        for row, m in enumerate(batch.members):
            self._finish(
                m,
                ScoreChunkResult(
                    token_logprobs=whole.token_logprobs[row : row + 1],
                    top_ids=whole.top_ids[row : row + 1],
                    top_logprobs=whole.top_logprobs[row : row + 1],
                    greedy_ids=whole.greedy_ids[row : row + 1],
                ),
            )


def end_session(end: Callable[[], None]) -> None:
    """Close an engine session (scoring or embedding): a failure is logged, since the session
    is dropped either way."""
    try:
        end()
    except Exception as exc:  # noqa: BLE001 - must not escape into the scheduler loop
        log.warning("%s failed: %s", getattr(end, "__name__", "ending the session"), exc)


def join_chunks(parts: list[ScoreChunkResult]) -> ScoreChunkResult:
    """Chunks' results [N, q] joined along the positions: [N, T]."""
    return ScoreChunkResult(
        token_logprobs=np.concatenate([c.token_logprobs for c in parts], axis=1),
        top_ids=np.concatenate([c.top_ids for c in parts], axis=1),
        top_logprobs=np.concatenate([c.top_logprobs for c in parts], axis=1),
        greedy_ids=np.concatenate([c.greedy_ids for c in parts], axis=1),
    )


def pad_rows(inputs: list[list[int]], rows: int, length: int) -> np.ndarray:
    """Tokens [rows, length]: each row padded with its last token; extra rows copy row 0 so
    every id is valid (they are never read)."""
    tokens = np.empty((rows, length), dtype=np.int32)
    for r in range(rows):
        p = inputs[r] if r < len(inputs) else inputs[0]
        tokens[r, : len(p)] = p
        tokens[r, len(p) :] = p[-1]
    return tokens
