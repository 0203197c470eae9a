"""Core ML engine (macOS): drives a stateful `.mlpackage` from `llm-convert --to coreml`.

The graph has fixed rows and one KV state per session; rows and cursors are expressed purely
through inputs (see converters/coreml_export.py):
- a slot with position_ids < 0 writes nothing to the cache, so rows that take no part in a call
  (the other rows during one row's prefill, idle rows during decode) keep their cache untouched,
  whatever their cursor, including a full row;
- attn_mask row r, slot i shows columns 0..position_ids[r, i] (causal within the row) and hides
  the rest with MASK_HIDDEN (finite, so a fully hidden row yields finite garbage, not NaN).
`RowDriver` holds that logic in numpy with the forward passed in, so the numpy MIL interpreter
exercises it on Linux; `CoreMLEngine` plugs in `MLModel.predict` with a state from `make_state`.
Given another object with MLModel's face (llm_server/testing/coreml_interp.py: the interpreter),
the same serving code runs on Linux: the tests serve an export through it.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from llm_server.engines.contract import (
    EmbeddingInputUnsupported,
    EmbeddingsUnsupported,
    EngineError,
    ScoreChunkResult,
)
from llm_server.engines.forward.score_reduce import log_softmax, reduce_logprobs
from llm_server.engines.kv.budget import HeldBytes
from llm_server.engines.plan import StepPlan, StepResult

MASK_HIDDEN = -30000.0  # additive mask value for hidden columns (fp16-representable)

# run(inputs, session) -> logits [rows, q, vocab]; session is "decode" or "score".
Forward = Callable[[dict[str, np.ndarray], str], np.ndarray]


def call_inputs(
    positions: np.ndarray, tokens: np.ndarray, context_length: int
) -> dict[str, np.ndarray]:
    """Graph inputs for `tokens`/`positions` [rows, q]; negative positions write and see nothing."""
    columns = np.arange(context_length)
    visible = (columns[None, None, :] <= positions[:, :, None]) & (positions[:, :, None] >= 0)
    mask = np.where(visible, 0.0, MASK_HIDDEN).astype(np.float16)[:, None]  # [rows, 1, q, ctx]
    return {
        "input_ids": tokens.astype(np.int32),
        "attn_mask": mask,
        "position_ids": positions.astype(np.int32),
    }


class RowDriver:
    """Rows, cursors, chunking and padding on top of a fixed-shape stateful forward."""

    def __init__(self, rows: int, context_length: int, q_sizes: Sequence[int], forward: Forward):
        self.rows = rows
        self.context_length = context_length
        self.q_sizes = tuple(sorted(q_sizes))
        self.forward = forward
        self.cursors = [0] * rows
        self.score_cursor = 0

    def _run(self, session: str, slots: dict[int, tuple[list[int], int]], q: int) -> np.ndarray:
        """One forward: `slots` maps row -> (tokens, first position); other rows write nothing."""
        tokens = np.zeros((self.rows, q), dtype=np.int32)
        positions = np.full((self.rows, q), -1, dtype=np.int32)
        for row, (ids, start) in slots.items():
            tokens[row, : len(ids)] = ids
            positions[row, : len(ids)] = np.arange(start, start + len(ids))
        return self.forward(call_inputs(positions, tokens, self.context_length), session)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """(length, padded q) pieces covering n positions: full largest chunks, then one padded."""
        biggest, pieces = self.q_sizes[-1], []
        while n > 0:
            take = min(n, biggest)
            pieces.append((take, next(q for q in self.q_sizes if q >= take)))
            n -= take
        return pieces

    def prefill(self, row: int, tokens: Sequence[int]) -> np.ndarray:
        if not tokens or len(tokens) > self.context_length:
            raise ValueError(
                f"prompt of {len(tokens)} tokens does not fit 1..{self.context_length}"
            )
        self.cursors[row], done, logits = 0, 0, None
        for take, q in self._chunks(len(tokens)):
            out = self._run("decode", {row: (list(tokens[done : done + take]), done)}, q)
            logits, done = out[row, take - 1], done + take
        self.cursors[row] = len(tokens)
        return np.asarray(logits, dtype=np.float32)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        for row in rows:
            if self.cursors[row] >= self.context_length:
                raise EngineError(f"row {row} is full ({self.context_length} positions)")
        out = self._run(
            "decode", {r: ([t], self.cursors[r]) for r, t in zip(rows, tokens, strict=True)}, 1
        )
        for row in rows:
            self.cursors[row] += 1
        return np.asarray(out[list(rows), 0], dtype=np.float32)

    def score_chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        n, q = tokens.shape
        if n > self.rows or self.score_cursor + q > self.context_length:
            raise ValueError(f"scoring chunk {tokens.shape} does not fit the graph")
        # the chunk in the graph's sizes: a context under 128 (its largest q size) can be handed
        # a chunk that no one size holds (context 100: 100 positions, sizes up to 64)
        parts, done = [], 0
        for take, size in self._chunks(q):
            start = self.score_cursor + done
            slots = {r: (list(tokens[r, done : done + take]), start) for r in range(n)}
            parts.append(self._run("score", slots, size)[:n, :take])
            done += take
        logits = np.concatenate(parts, axis=1)
        self.score_cursor += q
        return reduce_logprobs(log_softmax(np.array(logits, dtype=np.float32)), targets, top_k)


def _package_of(model_path: Path) -> Path:
    if model_path.suffix == ".mlpackage":
        return model_path
    packages = sorted(model_path.glob("*.mlpackage"))
    if not packages:
        raise FileNotFoundError(f"{model_path}: no .mlpackage found")
    return packages[0]


def require_macos_15(system: str | None = None, release: str | None = None) -> None:
    """Raise one clear error unless this is macOS 15 or later (the export's KV cache is a Core ML
    state, an iOS 18 / macOS 15 feature: an older Core ML cannot load the graph)."""
    system = sys.platform if system is None else system
    if system != "darwin":
        raise RuntimeError("the Core ML engine runs only on macOS 15+; use --backend mlx here")
    release = platform.mac_ver()[0] if release is None else release
    try:
        major = int(release.split(".")[0])
    except ValueError:
        return  # an unreadable version: let Core ML decide
    if major < 15:
        raise RuntimeError(
            f"the Core ML engine needs macOS 15 or later (stateful KV cache); this is macOS "
            f"{release}: use --backend mlx, or serve the MLX export of the same model"
        )


def _load(package: Path):
    import coremltools as ct

    return ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.ALL)


class CoreMLEngine:
    """Engine protocol on `MLModel.predict` with `make_state` (macOS 15+ only)."""

    name = "coreml"
    pipelined = False  # each predict() is synchronous
    score_rows = 0  # scores on its separate session (the fallback, scheduler/score_session.py)
    dynamic_shapes = False
    padded_shapes = True  # q must be one of the enumerated sizes
    dtype = "float16"
    serial_reason = None  # the export's row count decides batching (probe.py)
    shared_prefix_min = 0  # no prefix reuse on Core ML states
    prefix_cache = None
    has_lm_head = True
    speculative = False  # a Core ML state cannot be rewound
    kernels_name = None  # the compiled package runs its own kernels
    kv_format_name = None  # the package holds its own KV state

    @staticmethod
    def kv_token_bytes() -> None:
        return None

    no_embeddings = (
        "the coreml engine does not compute embeddings; serve the model with the MLX engine"
    )

    def thread_exit(self) -> None:
        """Nothing is held per thread."""

    def __init__(self, model_path: str | Path, model=None) -> None:
        """`model`: an object with MLModel's `user_defined_metadata`, `make_state()` and
        `predict(inputs, state=)` (default: the package loaded by Core ML, macOS 15+)."""
        if model is None:
            require_macos_15()  # first: on Linux or an old macOS this is the one error
        package = _package_of(Path(model_path))
        self.model = _load(package) if model is None else model
        manifest = json.loads(self.model.user_defined_metadata["llm_manifest"])
        self.rows = int(manifest["rows"])
        self.context_length = int(manifest["context_length"])
        self.vocab_size = int(manifest["vocab_size"])
        self._states = {"decode": self.model.make_state(), "score": None}
        self._driver = RowDriver(self.rows, self.context_length, manifest["q_sizes"], self._forward)

    def _forward(self, inputs: dict[str, np.ndarray], session: str) -> np.ndarray:
        try:
            return self.model.predict(inputs, state=self._states[session])["logits"]
        except Exception as exc:  # Core ML raises bare RuntimeErrors; keep the request's context
            raise EngineError(f"Core ML predict failed: {exc}") from exc

    def prefill(self, row: int, tokens: Sequence[int]) -> np.ndarray:
        return self._driver.prefill(row, tokens)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return self._driver.decode(rows, tokens)

    def run(self, plan: StepPlan) -> StepResult:
        return run_by_primitives(self, plan)  # no mixed forward: prompts prefill whole

    def check_spans(self, length: int, spans) -> None:
        if spans:
            raise EmbeddingInputUnsupported("coreml: the model's forward cannot take embeddings")

    def cursor(self, row: int) -> int:
        return self._driver.cursors[row]

    def cached_tokens(self, row: int) -> int:
        return 0  # no prefix cache on Core ML states

    def release(self, row: int) -> None:
        # Stale K/V stay in the state: masks never show positions at or past the cursor.
        self._driver.cursors[row] = 0

    def score_begin(self, batch: int) -> None:
        self._states["score"] = self.model.make_state()
        self._driver.score_cursor = 0

    def score_chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        return self._driver.score_chunk(tokens, targets, top_k)

    def score_end(self) -> None:
        self._states["score"] = None

    def preferred_row(self, tokens: list[int], rows: list[int]) -> int | None:
        return None  # no row keeps a history to reuse

    def held_bytes(self) -> HeldBytes:
        return HeldBytes()  # Core ML holds its state itself: nothing counted here

    def kv_bytes_for(self, positions: int) -> int:
        return 0

    def kv_room(self) -> int | None:
        return None

    def budget_bytes(self) -> int | None:
        return None

    def kept_tokens(self) -> int:
        return 0

    def idle_due(self) -> float | None:
        return None  # the state is allocated once, never given back while loaded

    def trim_idle(self, force: bool = False) -> bool:
        return False

    def rewind(self, row: int, cursor: int) -> None:
        raise EngineError("a Core ML row cannot be rewound")

    def group_status(self) -> None:
        return None

    def embed_begin(self, batch: int) -> None:
        raise EmbeddingsUnsupported(self.no_embeddings)

    def embed_chunk(self, tokens: np.ndarray) -> np.ndarray:
        raise EmbeddingsUnsupported(self.no_embeddings)

    def embed_end(self) -> None:
        pass  # no session was opened


def run_by_primitives(engine: CoreMLEngine, plan: StepPlan) -> StepResult:
    """Execute `plan` with `prefill` and `decode` alone, for engines without a mixed forward
    (Core ML): one decode forward, then each chunk's prompt prefilled whole on a fresh row
    (such engines cannot resume a prompt, so a chunk there always completes its prompt)."""
    rows: list[int] = []
    parts: list[np.ndarray] = []
    cursors: dict[int, int] = {}
    cached: dict[int, int] = {}
    if plan.score:
        raise ValueError(f"{engine.name} has no scoring rows (score_rows = 0)")
    if any(c.spans for c in plan.prefill):
        raise ValueError(f"{engine.name}: the model's forward cannot take embeddings")
    if plan.decode:
        rows += [d.row for d in plan.decode]
        parts.append(engine.decode(rows, [d.token for d in plan.decode]))
    for chunk in plan.prefill:
        if not chunk.fresh:
            raise ValueError(f"{engine.name} cannot resume a prompt at position {chunk.start}")
        parts.append(engine.prefill(chunk.row, chunk.prompt)[None])
        rows.append(chunk.row)
        cursors[chunk.row] = len(chunk.prompt)
        cached[chunk.row] = engine.cached_tokens(chunk.row)
    logits = np.concatenate(parts) if parts else np.zeros((0, engine.vocab_size), np.float32)
    return StepResult(tuple(rows), logits, cursors, cached)
