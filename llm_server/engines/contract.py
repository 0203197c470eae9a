"""The engine contract the scheduler drives (docs/ARCHITECTURE.md, "The engine contract").

An engine owns a fixed number of rows that share one KV cache; each row has its own cursor.
A serial engine is the same contract with one row. Engines are driven from ONE thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llm_server.engines.plan import EmbeddingSpan, ScoreChunkResult, StepPlan, StepResult

if TYPE_CHECKING:
    from llm_server.engines.kv.budget import HeldBytes
    from llm_server.engines.kv.prefix_cache import PrefixCache

# The scoring session advances this many positions per forward (C3).
SCORE_CHUNK = 128
# The last scoring chunk pads up to one of these position counts (C4).
SCORE_BUCKETS = (16, 32, 64, 128)


class EngineError(RuntimeError):
    """A forward failed; the scheduler isolates the request(s) that caused it (S8)."""


class EmbeddingsUnsupported(EngineError):
    """The model has no hidden-state forward to embed with (a client error: HTTP 400)."""


class EmbeddingInputUnsupported(EngineError):
    """A prompt carries embedding spans and the model's forward cannot take them (HTTP 400)."""


class Engine(Protocol):
    name: str  # "mlx" | "coreml"
    rows: int  # batch rows of the graph
    context_length: int  # max positions per row
    vocab_size: int
    dtype: str  # "float32" | "float16" | "bfloat16"
    serial_reason: str | None  # why the engine serves one row although more were asked (S1)
    # a fresh row copies a prompt prefix of at least this many tokens from another row that
    # holds it (0: never); the planner holds a newcomer back a step to let it (planner.py)
    shared_prefix_min: int
    dynamic_shapes: bool  # True when any batch size / query length can be fed (MLX)
    # True when a new input shape costs a compile or an allocation (Core ML, compiled graphs):
    # the scorer then pads the last chunk to SCORE_BUCKETS and rows to a power of two (C4).
    padded_shapes: bool
    # False for an embedding checkpoint without an LM head: it serves /v1/embeddings only
    has_lm_head: bool
    # True when decode_start/decode_finish/decode_cancel exist: a step can be started on the
    # lazy greedy ids of a step still in flight (the scheduler pipelines greedy decoding)
    pipelined: bool
    # True when `run` verifies decode rows' drafts (DecodeRow.draft: logits at every position,
    # StepResult.verified) and `rewind(row, cursor)` drops rejected positions (MLX; a row
    # with recurrent state only within its last drafted step); False: the scheduler never drafts
    speculative: bool
    # scoring rows the row store holds after the `rows` serving rows (rows .. rows+score_rows-1):
    # scoring chunks then ride in `run(plan)` (StepPlan.score). 0: the engine scores
    # on its separate session (`score_begin`/`score_chunk`), the fallback
    # (scheduler/scorer.py)
    score_rows: int
    # the prompt prefix cache (its stats on /health; None: the engine reuses no prefix)
    prefix_cache: PrefixCache | None
    # the kernel set the forwards run on (engines/forward/kernels.py; None: the engine has none)
    kernels_name: str | None
    # how the KV store holds keys and values (engines/kv/format.py: "float32", "float16",
    # "int8/g64"...; None: the engine has no row store of its own)
    kv_format_name: str | None
    # why embed_begin/embed_chunk/embed_end are not served (None: they are); an HTTP 400
    no_embeddings: str | None

    def kv_token_bytes(self) -> int | None:
        """KV bytes one position of one row takes in every layer, in the store's format
        (None: not known)."""
        ...

    def preferred_row(self, tokens: list[int], rows: list[int]) -> int | None:
        """The free row of `rows` to open `tokens` on (the one still holding the longest
        prefix of it; None: no preference, the lowest)."""
        ...

    def kept_tokens(self) -> int:
        """Positions of released rows' histories held only in their rows (PrefixCacheStats)."""
        ...

    def held_bytes(self) -> HeldBytes:
        """Bytes held now by kind (weights, KV, prefix cache): what the memory budget counts."""
        ...

    def kv_bytes_for(self, positions: int) -> int:
        """Bytes one row holds at `positions` (a prompt's KV, before it is admitted)."""
        ...

    def kv_room(self) -> int | None:
        """Bytes of KV the memory budget could ever give this model (None: no budget)."""
        ...

    def budget_bytes(self) -> int | None:
        """The memory budget this engine draws on (None: none)."""
        ...

    def idle_due(self) -> float | None:
        """Seconds until the idle KV memory is given back (`trim_idle`; None: none held)."""
        ...

    def trim_idle(self, force: bool = False) -> bool:
        """Give the idle KV memory back once its keep-alive is over, or now with `force` (a
        request waits for room in the memory budget); True: it was."""
        ...

    def rewind(self, row: int, cursor: int) -> None:
        """Drop `row`'s positions from `cursor` on (a draft's rejected ids; `speculative`). A row
        with recurrent state rewinds only within the step that verified its draft, and before
        any other step (its state is rebuilt from the one before that step)."""
        ...

    def group_status(self) -> dict[str, Any] | None:
        """The group of ranks the model is split over, as /health reports it (None: one
        process)."""
        ...

    def prefill(self, row: int, tokens: Sequence[int]) -> np.ndarray:
        """Reset `row`, run `tokens` through it (chunked); its cursor becomes len(tokens).

        Other rows' caches are untouched. Returns the last position's logits [vocab] float32.
        """
        ...

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Append one token to each row at its own cursor in ONE batched forward.

        Returns each row's logits [len(rows), vocab] float32; each cursor advances by one.
        """
        ...

    def run(self, plan: StepPlan) -> StepResult:
        """Execute the forward part of a step plan (engines/plan.py): every decode row advances
        one token and every prompt chunk is written at its row's cursor (a fresh row is reset
        first and may start past a reused prefix); every scoring chunk runs on its scoring row
        and is reduced to log-probabilities (C3; engines with `score_rows` only). Rows advance
        only if the whole step succeeded; on an error nothing moved (the scheduler then
        retries per request, S8). Returns the last-position logits of the decode rows and of
        rows whose prompt ended, and the scoring chunks' results (`StepResult.scores`).
        """
        ...

    def check_spans(self, length: int, spans: Sequence[EmbeddingSpan]) -> None:
        """Admission of a prompt of `length` positions carrying embedding spans (step.py:
        `EmbeddingSpan`): EmbeddingInputUnsupported when the model's forward cannot take
        embeddings, ValueError when the spans do not fit the prompt or the model's width."""
        ...

    # Only when `pipelined` (see PipelinedEngine; the scheduler uses `run` otherwise).

    def cursor(self, row: int) -> int:
        """Positions currently held in `row`'s cache."""
        ...

    def cached_tokens(self, row: int) -> int:
        """Prompt tokens of `row`'s last prefill that were reused from a prefix cache (0: none)."""
        ...

    def release(self, row: int) -> None:
        """Forget `row`'s cache (cursor 0) so a new request can take it."""
        ...

    def thread_exit(self) -> None:
        """The thread driving the engine is about to end: free what it holds per thread."""
        ...

    # The scoring session: the fallback for engines whose row store cannot hold scoring rows.

    def score_begin(self, batch: int) -> None:
        """Open a fresh scoring session of `batch` rows, separate from the decode rows."""
        ...

    def score_chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        """Run `tokens` [N, q] on the scoring session at its cursor; reduce to log-probs.

        `targets` [N, q] are the ids whose log-probability is returned per position.
        """
        ...

    def score_end(self) -> None:
        """Free the scoring session's cache."""
        ...

    # The embedding session (when `no_embeddings` is None): hidden states, pooled by the
    # scheduler's embedder (scheduler/embedder.py).

    def embed_begin(self, batch: int) -> None:
        """Open a fresh embedding session of `batch` rows (EmbeddingsUnsupported: none)."""
        ...

    def embed_chunk(self, tokens: np.ndarray) -> np.ndarray:
        """Run `tokens` [N, q] at the session's cursor; their last hidden states [N, q, H]."""
        ...

    def embed_end(self) -> None:
        """Free the embedding session's cache."""
        ...


class DecodeStep(Protocol):
    """A decode step started by `PipelinedEngine.decode_start` and not yet finished."""

    rows: list[int]  # the rows it advances, in the order their tokens were given
    greedy: Any  # lazy [len(rows)] argmax ids: the tokens a greedy next step may start on


class PipelinedEngine(Engine, Protocol):
    """An engine whose decode steps can be started before the previous one has finished
    (`pipelined` True): the scheduler's pipeline (scheduler/pipelining.py) starts step n+1 on
    the lazy greedy ids of step n for decode-only plans."""

    def decode_start(self, rows: Sequence[int], tokens: Sequence[int] | Any) -> DecodeStep:
        """Build one decode step and start it; `tokens` may be `step.greedy` of a step still
        in flight. Returns at once."""
        ...

    def decode_finish(self, step: DecodeStep) -> np.ndarray:
        """Wait for `step`; advance its rows (those not released since it started); return
        their logits [len(rows), vocab]."""
        ...

    def decode_cancel(self, step: DecodeStep) -> None:
        """Drop `step` without advancing any row (waits for it: nothing is left computing)."""
        ...
