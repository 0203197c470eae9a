"""The MLX engine's scoring and embedding sessions: padded batches on caches of their own, so
the decode rows are never disturbed (C1, C3). Scoring uses its session only as the fallback
for models whose row store holds no scoring rows (`score_rows` 0, see mlx_engine.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from llm_server.engines.contract import EmbeddingsUnsupported, EngineError, ScoreChunkResult
from llm_server.engines.forward.kernels import KernelSet
from llm_server.engines.forward.model import ModelForward
from llm_server.engines.mlx.layout import make_cache


class _Session:
    """One padded batch at a time on mlx-lm caches of its own, advanced chunk by chunk."""

    def __init__(self, model: Any, batch_name: str) -> None:
        self.model = model
        self._batch_name = batch_name  # for errors: "a scoring batch"
        self._cache: list | None = None
        self._offset = 0  # positions each row of the batch holds

    def begin(self, batch: int) -> None:
        """Open a fresh session of `batch` rows, separate from the decode rows."""
        if batch < 1:
            raise ValueError(f"{self._batch_name} needs at least one row")
        self._cache = make_cache(self.model)
        self._offset = 0

    def end(self) -> None:
        self._cache = None
        self._offset = 0


class ScoreSession(_Session):
    """The engine's `score_*`: the scoring fallback of models without scoring rows."""

    def __init__(self, forward: ModelForward, kernels: KernelSet) -> None:
        super().__init__(forward.model, "a scoring batch")
        self.forward = forward
        self.kernels = kernels

    def chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        if self._cache is None:
            raise RuntimeError("score_begin() must be called before score_chunk()")
        # prompts were checked once, when queued (scheduler/scorer.py: check_prompts), and the
        # session's chunks never pass the context (score_session.chunk_sizes)
        n, q = tokens.shape
        ids = mx.array(np.asarray(tokens, dtype=np.int32))
        fused = self.forward.fused
        context = self.forward.context(n * q)
        with context:  # as in ModelForward.run_groups
            try:
                if fused is not None:
                    mask = "causal" if q > 1 else None  # every row at the same offset
                    starts = [self._offset] * n
                    logits = fused.forward(ids, self._cache, starts, mask, context, last_only=False)
                else:
                    logits = self.model(ids, cache=self._cache)
                result = self.kernels.reduce_scores(logits, targets, top_k)
            except Exception as exc:  # noqa: BLE001
                raise EngineError(f"scoring forward failed: {exc}") from exc
        self._offset += q
        return result


class EmbedSession(_Session):
    """The engine's `embed_*` (a scoring batch may be open meanwhile: caches of its own)."""

    def __init__(
        self, model: Any, inner: str | None, *, context_length: int, vocab_size: int, name: str
    ) -> None:
        """`inner`: the model's decoder-stack attribute (None: none known); `name`: the model
        type, for errors."""
        super().__init__(model, "an embedding batch")
        self.inner = inner
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.name = name

    def chunk(self, tokens: np.ndarray) -> np.ndarray:
        """Final-norm hidden states [N, q, hidden] float32 of `tokens` [N, q] at the session's
        cursor (the scoring forward without the LM head)."""
        if self._cache is None:
            raise RuntimeError("embed_begin() must be called before embed_chunk()")
        q = tokens.shape[1]
        if self._offset + q > self.context_length:
            raise ValueError(f"embedding past the context of {self.context_length} positions")
        if self.inner is None:
            raise EmbeddingsUnsupported(f"{self.name}: no decoder stack known to embed with")
        ids = mx.array(np.asarray(tokens, dtype=np.int32))
        try:
            stack = getattr(self.model, self.inner)
            hidden = stack(ids, cache=self._cache).astype(mx.float32)
            mx.eval(hidden)
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"embedding forward failed: {exc}") from exc
        if hidden.ndim != 3 or hidden.shape[-1] == self.vocab_size:  # a wrapper gave logits
            raise EmbeddingsUnsupported(
                f"{self.name}: the decoder stack does not return hidden states"
            )
        self._offset += q
        return np.array(hidden)


def all_position_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Logits [N, q, vocab] of a padded batch on a fresh scoring cache (tests, tools)."""
    cache = make_cache(model)
    ids = mx.array(np.asarray(tokens, dtype=np.int32))
    logits = model(ids, cache=cache).astype(mx.float32)
    mx.eval(logits)
    return np.array(logits)
