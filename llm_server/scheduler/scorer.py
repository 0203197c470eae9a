"""Scoring (`/v1/completions` echo+logprobs) in padded batches between decode steps (C1-C4).

Algorithm: a request's prompts enter one queue together (C1). When no batch is open, the pump
takes queued prompts shortest first and stops before a third of the batch's positions would be
padding (C2). Each `run_batch` call then runs ONE forward of 128 positions on the engine's
scoring session (C3), so decoding never waits longer than one scoring forward; the last chunk
pads to a bucket of 16/32/64/128 positions, never past the context (C4). A request completes
when all of its prompts have been scored.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from llm_server.decoding import MAX_TOP_LOGPROBS
from llm_server.engines.base import SCORE_BUCKETS, SCORE_CHUNK, Engine, ScoreChunkResult
from llm_server.scheduler.shortest_first import PumpRequest, ShortestFirstQueue

log = logging.getLogger(__name__)

MAX_SCORE_BATCH = 32  # prompts per scoring batch (rows of the scoring session)
TRACE_LIMIT = 4096  # scoring forwards remembered for tests and diagnostics


@dataclass(frozen=True)
class ScoredPrompt:
    """Log-probabilities of one prompt (plus an optional greedy next token)."""

    tokens: list[int]  # prompt ids, then the generated token when one was asked for
    token_logprobs: list[float | None]  # per token; the first entry is None
    top_logprobs: list[list[tuple[int, float]] | None]  # per token, best first; first is None
    generated: int | None  # the greedy next token id (max_tokens 1), else None


@dataclass(frozen=True)
class ScoreForward:
    """One scoring forward as it ran (the trace tests read)."""

    batch: int  # sequence number of the scoring batch
    rows: int  # rows fed to the engine (after power-of-two rounding)
    q: int  # positions in this forward
    offset: int  # scoring-session cursor before this forward
    lengths: tuple[int, ...]  # real prompt lengths of the batch, in row order
    requests: tuple[int, ...]  # ScoreRequest.seq of each real row


class ScoringError(RuntimeError):
    """A scoring forward failed; every request in that batch gets this error."""


_seqs = itertools.count(1)


@dataclass(eq=False)
class ScoreRequest(PumpRequest):
    """One completions request: all its prompts score together; `future` gets the results."""

    prompts: list[list[int]]
    top_k: int
    generate_one: bool
    future: Future = field(default_factory=Future)
    seq: int = field(default_factory=lambda: next(_seqs))
    results: list[ScoredPrompt | None] = field(default_factory=list)
    remaining: int = 0
    started: bool = False  # a prompt entered a batch; the caller can no longer cancel

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)
        self.remaining = len(self.prompts)


@dataclass(frozen=True)
class _Queued:
    request: ScoreRequest
    index: int  # which of the request's prompts

    @property
    def tokens(self) -> list[int]:
        return self.request.prompts[self.index]


@dataclass(eq=False)
class _Batch:
    """An open scoring batch: padded inputs plus the per-chunk results gathered so far."""

    seq: int
    members: list[_Queued]
    tokens: np.ndarray  # [rows, length] int32, each row padded with its last token
    targets: np.ndarray  # [rows, length] int32, the next token per position
    chunks: list[int]  # positions per forward
    top_k: int  # k asked of the engine (max over members, >= 1 when a token is generated)
    offset: int = 0
    done: list[ScoreChunkResult] = field(default_factory=list)


def check_prompts(prompts: Sequence[Sequence[int]], context_length: int, top_k: int) -> None:
    """Raise ValueError with numbers a user can act on when a scoring request cannot run."""
    if not prompts:
        raise ValueError("prompt must not be empty")
    if not 0 <= top_k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top_k}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > context_length:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; the model's context is {context_length} tokens"
            )


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


class Scorer:
    """The scheduler's pump: queues score requests and advances one batch per call."""

    def __init__(
        self,
        wake: Callable[[], None] = lambda: None,
        max_batch: int = MAX_SCORE_BATCH,
        max_queued: int = 64,
        retry_after: float = 1.0,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.max_batch = max_batch
        self._queue = ShortestFirstQueue(wake, max_queued, retry_after, "scoring")
        self._batch: _Batch | None = None  # owned by the scheduler thread
        self._batch_seqs = itertools.count(1)
        self.trace: collections.deque[ScoreForward] = collections.deque(maxlen=TRACE_LIMIT)

    # -- any thread ------------------------------------------------------------------

    def submit(self, prompts: list[list[int]], top_k: int, generate_one: bool) -> ScoreRequest:
        """Queue every prompt of one request together (C1); raises QueueFull/SchedulerClosed."""
        req = ScoreRequest([list(p) for p in prompts], top_k, generate_one)
        self._queue.push(req, [_Queued(req, i) for i in range(len(req.prompts))])
        return req

    def pending(self) -> bool:
        return self._batch is not None or bool(self._queue)

    def close(self) -> None:
        """Refuse new requests and fail the queued ones (the scheduler thread has stopped)."""
        for item in self._queue.close():
            item.request.fail(self._queue.closed_error())

    # -- the scheduler thread --------------------------------------------------------

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
            self._close_batch(engine)
            self._fail_batch(batch, exc)
            return
        if batch.offset >= batch.tokens.shape[1]:
            self._close_batch(engine)
            self._deliver(batch)

    def _open(self, engine: Engine) -> _Batch | None:
        """Take the next batch off the queue (C2) and open a scoring session for it."""
        cap = self.max_batch if engine.dynamic_shapes else min(self.max_batch, engine.rows)
        members = [m for m in self._queue.take(cap) if m.request.claim()]
        if not members:
            return None
        pad = engine.padded_shapes
        rows = padded_rows(len(members), cap, engine.dynamic_shapes and pad)
        tokens, targets = _pad([m.tokens for m in members], rows)
        chunks = chunk_sizes(tokens.shape[1], engine.context_length, buckets=pad)
        k = max(m.request.top_k for m in members)
        if any(m.request.generate_one for m in members):
            k = max(k, 1)  # the generated token's logprob is the top-1 entry
        batch = _Batch(
            seq=next(self._batch_seqs),
            members=members,
            tokens=_extend(tokens, sum(chunks)),
            targets=_extend(targets, sum(chunks)),
            chunks=chunks,
            top_k=min(k, engine.vocab_size),
        )
        try:
            engine.score_begin(rows)
        except Exception as exc:  # noqa: BLE001 - must not escape into the scheduler loop
            self._fail_batch(batch, exc)
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
        n = len(batch.members)  # padded rows are dropped here, never read
        batch.done.append(
            ScoreChunkResult(
                token_logprobs=result.token_logprobs[:n],
                top_ids=result.top_ids[:n],
                top_logprobs=result.top_logprobs[:n],
                greedy_ids=result.greedy_ids[:n],
            )
        )
        batch.offset = hi

    def _close_batch(self, engine: Engine) -> None:
        self._batch = None
        try:
            engine.score_end()
        except Exception as exc:  # noqa: BLE001 - the session is dropped either way
            log.warning("score_end failed: %s", exc)

    def _deliver(self, batch: _Batch) -> None:
        token_lp = np.concatenate([c.token_logprobs for c in batch.done], axis=1)  # [n, T]
        top_ids = np.concatenate([c.top_ids for c in batch.done], axis=1)  # [n, T, k]
        top_lp = np.concatenate([c.top_logprobs for c in batch.done], axis=1)
        greedy = np.concatenate([c.greedy_ids for c in batch.done], axis=1)  # [n, T]
        for row, m in enumerate(batch.members):
            req = m.request
            if req.abandoned:
                continue
            req.results[m.index] = _scored(
                m.tokens, token_lp[row], top_ids[row], top_lp[row], greedy[row], req
            )
            req.remaining -= 1
            if req.remaining == 0:
                req.future.set_result(list(req.results))

    def _fail_batch(self, batch: _Batch, exc: Exception) -> None:
        log.error("scoring batch %d failed: %s", batch.seq, exc)
        err = ScoringError(f"scoring failed: {exc}")
        for m in batch.members:
            m.request.fail(err)


def _pad(prompts: list[list[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and next-token targets [rows, longest]; padding repeats each row's last token.

    Extra rows copy row 0 so every id is valid; they are never read.
    """
    length = max(len(p) for p in prompts)
    tokens = np.empty((rows, length), dtype=np.int32)
    for r in range(rows):
        p = prompts[r] if r < len(prompts) else prompts[0]
        tokens[r, : len(p)] = p
        tokens[r, len(p) :] = p[-1]
    targets = np.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    return tokens, targets


def _extend(a: np.ndarray, length: int) -> np.ndarray:
    """Pad [rows, T] to [rows, length] by repeating the last column (bucket padding)."""
    extra = length - a.shape[1]
    return a if extra <= 0 else np.concatenate([a, np.repeat(a[:, -1:], extra, axis=1)], axis=1)


def _scored(
    tokens: list[int],
    token_lp: np.ndarray,  # [T] logprob of the next token per position
    top_ids: np.ndarray,  # [T, k]
    top_lp: np.ndarray,  # [T, k]
    greedy: np.ndarray,  # [T]
    req: ScoreRequest,
) -> ScoredPrompt:
    """One prompt's result: position i's outputs describe token i+1."""
    n, k = len(tokens), req.top_k
    lps: list[float | None] = [None] + [float(x) for x in token_lp[: n - 1]]
    tops: list[list[tuple[int, float]] | None] = [None] + [
        _top(top_ids[i], top_lp[i], k) for i in range(n - 1)
    ]
    generated = None
    out = list(tokens)
    if req.generate_one:
        generated = int(greedy[n - 1])
        out.append(generated)
        lps.append(float(top_lp[n - 1, 0]))
        tops.append(_top(top_ids[n - 1], top_lp[n - 1], k))
    return ScoredPrompt(tokens=out, token_logprobs=lps, top_logprobs=tops, generated=generated)


def _top(ids: np.ndarray, lps: np.ndarray, k: int) -> list[tuple[int, float]]:
    return [(int(i), float(lp)) for i, lp in zip(ids[:k], lps[:k], strict=True)]
