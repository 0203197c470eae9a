"""The MLX engine's scoring and embedding sessions: padded batches on caches of their own, so
the decode rows are never disturbed (C1, C3). Scoring uses its session only as the fallback
for models whose row store holds no scoring rows (`score_rows` 0, see mlx_engine.py).

Part of `MLXEngine` (a mixin, as mlx_steps.py is): it reads the engine's model, fused forward,
product split and context length.
"""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from llm_server import blas
from llm_server.engines.base import EmbeddingsUnsupported, EngineError, ScoreChunkResult
from llm_server.engines.layout import make_cache


class SessionRunner:
    """The `score_*` and `embed_*` halves of `MLXEngine`."""

    _score_cache: list | None = None
    _score_offset: int = 0
    _embed_cache: list | None = None
    _embed_offset: int = 0

    # -- scoring session -------------------------------------------------------------

    def score_begin(self, batch: int) -> None:
        if batch < 1:
            raise ValueError("a scoring batch needs at least one row")
        self._score_cache = make_cache(self.model)
        self._score_offset = 0

    def score_chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        if self._score_cache is None:
            raise RuntimeError("score_begin() must be called before score_chunk()")
        # prompts were checked once, when queued (scheduler/scorer.py: check_prompts), and the
        # session's chunks never pass the context (score_session.chunk_sizes)
        n, q = tokens.shape
        ids = mx.array(np.asarray(tokens, dtype=np.int32))
        split = self._split(n * q)
        with blas.threads(1) if split else nullcontext():  # as in _run_groups
            try:
                if self._fused is not None:
                    mask = "causal" if q > 1 else None  # every row at the same offset
                    starts = [self._score_offset] * n
                    logits = self._fused.forward(
                        ids, self._score_cache, starts, mask, split, last_only=False
                    )
                else:
                    logits = self.model(ids, cache=self._score_cache)
                result = self.kernels.reduce_scores(logits, targets, top_k)
            except Exception as exc:  # noqa: BLE001
                raise EngineError(f"scoring forward failed: {exc}") from exc
        self._score_offset += q
        return result

    def score_end(self) -> None:
        self._score_cache = None
        self._score_offset = 0

    # -- embedding session (its own cache: a scoring batch may be open meanwhile) ------

    def embed_begin(self, batch: int) -> None:
        """Open a fresh embedding session of `batch` rows, separate from decode and scoring."""
        if batch < 1:
            raise ValueError("an embedding batch needs at least one row")
        self._embed_cache = make_cache(self.model)
        self._embed_offset = 0

    def embed_chunk(self, tokens: np.ndarray) -> np.ndarray:
        """Final-norm hidden states [N, q, hidden] float32 of `tokens` [N, q] at the session's
        cursor (the scoring forward without the LM head)."""
        if self._embed_cache is None:
            raise RuntimeError("embed_begin() must be called before embed_chunk()")
        q = tokens.shape[1]
        if self._embed_offset + q > self.context_length:
            raise ValueError(f"embedding past the context of {self.context_length} positions")
        if self._inner is None:
            raise EmbeddingsUnsupported(f"{self.model_type}: no decoder stack known to embed with")
        ids = mx.array(np.asarray(tokens, dtype=np.int32))
        try:
            stack = getattr(self.model, self._inner)
            hidden = stack(ids, cache=self._embed_cache).astype(mx.float32)
            mx.eval(hidden)
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"embedding forward failed: {exc}") from exc
        if hidden.ndim != 3 or hidden.shape[-1] == self.vocab_size:  # a wrapper gave logits
            raise EmbeddingsUnsupported(
                f"{self.model_type}: the decoder stack does not return hidden states"
            )
        self._embed_offset += q
        return np.array(hidden)

    def embed_end(self) -> None:
        self._embed_cache = None
        self._embed_offset = 0

    def all_position_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits [N, q, vocab] of a padded batch on a fresh scoring cache (tests, tools)."""
        cache = make_cache(self.model)
        ids = mx.array(np.asarray(tokens, dtype=np.int32))
        logits = self.model(ids, cache=cache).astype(mx.float32)
        mx.eval(logits)
        return np.array(logits)
