"""Scoring reductions: log-probs [N, q, vocab] down to what a scoring chunk returns.

Shared by the engines, so every engine reports targets, top-k and greedy ids the same way.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from llm_server.engines.contract import ScoreChunkResult


def log_softmax(z: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis of float32 logits, in place; returns `z`."""
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z


def reduce_logprobs(logprobs: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
    """Token log-probs, greedy ids and top-k from log-probs [N, q, vocab] (numpy)."""
    tgt = np.asarray(targets, dtype=np.int64)[..., None]
    token_lp = np.take_along_axis(logprobs, tgt, axis=-1)[..., 0]
    greedy = logprobs.argmax(axis=-1)
    if top_k == 1:
        top_ids = greedy[..., None]
    elif top_k > 1:
        part = np.argpartition(-logprobs, top_k - 1, axis=-1)[..., :top_k]
        order = np.argsort(-np.take_along_axis(logprobs, part, axis=-1), axis=-1, kind="stable")
        top_ids = np.take_along_axis(part, order, axis=-1)
    else:
        top_ids = np.zeros((*greedy.shape, 0), dtype=np.int64)
    return ScoreChunkResult(
        token_logprobs=token_lp.astype(np.float32),
        top_ids=top_ids.astype(np.int32),
        top_logprobs=np.take_along_axis(logprobs, top_ids, axis=-1).astype(np.float32),
        greedy_ids=greedy.astype(np.int32),
    )


def reduce_logits_mlx(logits: mx.array, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
    """The same reduction on the MLX device (Metal), before anything leaves it."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [N, q, vocab]
    tgt = mx.array(np.asarray(targets, dtype=np.int32))[..., None]
    token_lp = mx.take_along_axis(logprobs, tgt, axis=-1)[..., 0]
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    n, q = greedy.shape
    if top_k > 0:
        top_ids = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., :top_k]
        top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_lp, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, axis=-1).astype(mx.int32)
        top_lp = mx.take_along_axis(top_lp, order, axis=-1)
    else:
        top_ids = mx.zeros((n, q, 0), mx.int32)
        top_lp = mx.zeros((n, q, 0), mx.float32)
    mx.eval(token_lp, greedy, top_ids, top_lp)
    return ScoreChunkResult(
        token_logprobs=np.array(token_lp),
        top_ids=np.array(top_ids),
        top_logprobs=np.array(top_lp),
        greedy_ids=np.array(greedy),
    )
