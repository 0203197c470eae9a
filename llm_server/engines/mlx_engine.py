"""MLX engine: mlx-lm model classes driven through a row-addressed KV cache.

Rows share one preallocated store; each row has its own cursor. Prefill touches one row,
decode runs every requested row in one batched forward with a per-row mask (mlx_decode.py), a
step plan runs decode rows, prompt chunks and scoring chunks in one forward (mlx_steps.py), and
the store holds `score_rows` scoring rows after the serving rows for those scoring chunks. Sliding-window layers get a per-row window
mask, recurrent layers a per-row state slot (see layout.py); a model whose caches cannot be held
per row is served on one row through mlx-lm's own caches (`serial_reason` says why).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from llm_server import blas
from llm_server.engines import cpu_kernels, quantized
from llm_server.engines.bare_checkpoint import model_classes
from llm_server.engines.base import EngineError
from llm_server.engines.dtypes import default_dtype
from llm_server.engines.fused_decode import FusedForward
from llm_server.engines.kernels import resolve as resolve_kernels
from llm_server.engines.layout import (
    GROUPED_SCORE_MODULES,
    KV,
    PLAIN_HEAD_MODULES,
    cache_layout,
    check_model_type,
    inner_name,
    last_logits,
    make_cache,
    model_family,
    row_views,
)
from llm_server.engines.mlx_decode import DecodeRunner
from llm_server.engines.mlx_sessions import SessionRunner
from llm_server.engines.mlx_steps import StepRunner
from llm_server.engines.prefix_cache import PrefixCache, default_bound, kv_token_bytes
from llm_server.engines.probe import supports_batching
from llm_server.engines.row_cache import ForwardPlan, RowStore, row_mask
from llm_server.engines.row_state import StateStore
from llm_server.engines.selfcheck import VERIFIED_FAMILIES, row_forward_problem
from llm_server.engines.settings import EngineSettings
from llm_server.native import skinny

log = logging.getLogger(__name__)

SPLIT_MAX_POSITIONS = 256  # forwards up to this many positions split their products (see _split)
PREFILL_CHUNK = 512  # prompt positions per prefill forward (bounds activation memory)
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class MLXEngine(StepRunner, DecodeRunner, SessionRunner):
    """Engine protocol implementation on MLX (Metal on a Mac, the CPU on Linux)."""

    name = "mlx"
    dynamic_shapes = True

    def __init__(self, model_path: str | Path, settings: EngineSettings | None = None) -> None:
        """Load the model at `model_path` as `settings` say (engines/settings.py)."""
        from mlx_lm.utils import load_model

        settings = EngineSettings() if settings is None else settings
        self.settings = settings
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
        rows = settings.rows
        if rows > 1 and not supports_batching(path):
            rows = 1  # an export with one row or no attn_mask (the scheduler warns, S1)
        self.kernels = resolve_kernels(settings.kernels)
        dtype = settings.dtype or default_dtype(path)  # engines/dtypes.py
        prefix_cache_bytes = settings.prefix_cache_bytes
        fused_decode, pipeline = settings.fused_decode, settings.pipeline
        score_rows = settings.score_rows
        config = json.loads((path / "config.json").read_text())
        check_model_type(config)
        text = {**config, **config.get("text_config", {})}  # multimodal configs nest the LM's
        # bare-transformer checkpoints (embedding models) load too; see bare_checkpoint
        self.model, self.config = load_model(path, lazy=True, get_model_classes=model_classes)
        self.stage = None  # this rank's layers when split pipeline-parallel (a pipeline.Stage)
        group = settings.group
        if settings.sharded:
            from llm_server.distributed.pipeline import split_model

            if settings.parallel == "pipeline":
                self.stage = split_model(self.model, group)  # while lazy, as shard() below
            else:
                if not hasattr(self.model, "shard"):
                    raise ValueError(f"{config['model_type']} has no tensor-parallel shard()")
                for key in ("num_attention_heads", "num_key_value_heads"):
                    if int(text.get(key) or 0) % group.size():
                        raise ValueError(
                            f"{key}={text[key]} does not split over {group.size()} ranks"
                        )
                self.model.shard(group)  # while lazy: each rank materialises its slices only
            # the prefix cache evicts by bytes: every rank must count the same (the heads split
            # evenly, a pipeline stage counts the whole model's layers), from the same bound
            if prefix_cache_bytes is None:  # from the config: every rank computes the same
                prefix_cache_bytes = default_bound(kv_token_bytes(text, _DTYPES[dtype].size))
            fused_decode, pipeline, score_rows = False, False, 0
        self.has_lm_head = getattr(self.model, "has_lm_head", True)
        ks = self.kernels
        self.quantized = quantized.prepare(self.model, settings.keep_quantized, ks.dequantize)
        cpu_kernels.install(self.model, ks.numpy_large)  # numpy softmax/SiLU for big tensors
        self.model.set_dtype(_DTYPES[dtype])
        max_pos = int(text.get("max_position_embeddings") or 2048)
        self.context_length = min(settings.context_length or max_pos, max_pos)
        self._layout = cache_layout(self.model)
        self.model_type = str(config["model_type"])
        # why this model serves one request at a time (None: its rows batch)
        self.serial_reason: str | None = None
        if self._layout.serial_reason is not None:
            self.serial_reason = f"{self.model_type}: {self._layout.serial_reason}"
        self._inner = inner_name(self.model)
        self._plain_head = model_family(self.model) in PLAIN_HEAD_MODULES
        self._grouped_scores = model_family(self.model) in GROUPED_SCORE_MODULES
        # decode steps with stacked q/k/v and gate/up products (None: mlx-lm's forward). Built
        # while the weights are still lazy, so the separate ones only ever exist one layer at a
        # time: stacking loaded weights instead left ~280 MB of freed (but resident) heap.
        fusable = fused_decode and self._plain_head and self._layout.plain
        fusable = fusable and self.serial_reason is None
        self._fused = (
            FusedForward.build(self.model, self.context_length, self.kernels) if fusable else None
        )
        compiled_decode = settings.compiled_decode
        if compiled_decode is None:
            compiled_decode = ks.compiled_decode
        if compiled_decode and self._fused is not None:
            self._fused.enable_compiled()
        mx.eval(self.model.parameters())
        mx.clear_cache()  # the buffers freed while stacking
        if self._fused is None and self._plain_head and ks.split_products:  # fused: its own
            cpu_kernels.split_linears(self.model)  # 1-2 row decode products use both cores
        self.model_path = path
        self._pipeline = ks.pipeline if pipeline is None else pipeline
        self.padded_shapes = settings.padded_shapes
        self.dtype = dtype
        self.vocab_size = int(text["vocab_size"])
        self.num_layers = len(self._layout.leaves)  # caches of the model's cache list
        self._split_steps = 0  # split decode steps in flight (BLIS held to one thread meanwhile)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = default_bound(kv_token_bytes(text, _DTYPES[dtype].size))
        self._prefix_cache_bytes = prefix_cache_bytes
        self._score_rows = score_rows
        self._init_rows(rows)
        if self.serial_reason is None and model_family(self.model) not in VERIFIED_FAMILIES:
            problem = row_forward_problem(self)  # an architecture the tests do not cover
            if problem is not None:
                self.serial_reason = f"{self.model_type}: {problem}"
                self._init_rows(1)
            else:
                self._init_rows(rows)  # forget the check's rows (prefix cache included)

    def _init_rows(self, rows: int) -> None:
        """Empty rows (`rows` of them, 1 when serving serially) and the prefix cache."""
        serial = self.serial_reason is not None
        self.rows = 1 if serial else rows
        # a recurrent state cannot be rewound: a step is never started before the last one
        # finished (a cancelled early step would have advanced it), and no prefix is reused
        rewindable = not (self._layout.stateful or serial)
        self.pipelined = self._pipeline and rewindable
        # drafts can be verified (logits at every position) and rejected positions dropped
        all_positions = rewindable and (self._fused is not None or self._plain_head)
        self.speculative = all_positions
        # scoring rows need logits at every position and no state carried between prompts
        self.score_rows = self._score_rows if all_positions else 0
        total = self.rows + self.score_rows  # store rows: the serving rows, then scoring rows
        self._store = RowStore(self.num_layers, total, self.context_length, first_rows=self.rows)
        states = [(i, c.size) for i, c in enumerate(self._layout.leaves) if c.kind != KV]
        self._states = StateStore([i for i, _ in states], total, [n for _, n in states])
        self._serial_cache: list | None = None  # mlx-lm's caches of the one row (serial mode)
        # ids whose KV each row holds; a row's cursor is the length of its list
        self._row_tokens: list[list[int]] = [[] for _ in range(total)]
        self.row_cached = [0] * total  # prompt tokens the last prefill took from the cache
        self._ahead = [0] * total  # decode steps started on a row and not yet finished
        self._epoch = [0] * total  # bumped by release(): in-flight steps are then void
        self.prefix_cache = PrefixCache(
            self._prefix_cache_bytes if rewindable else 0, layers=self._counted_layers()
        )

    def _counted_layers(self) -> tuple[int, int]:
        """(layers the prefix cache counts bytes for, layers this rank holds): a pipeline
        stage counts the whole model's, so every rank evicts the same entries."""
        if self.stage is None:
            return (1, 1)
        return (self.stage.total, len(self.stage.layers))

    # -- decode rows -----------------------------------------------------------------

    def cursor(self, row: int) -> int:
        return len(self._row_tokens[row])

    def release(self, row: int) -> None:
        """Free `row`; a serving row's history (prompt + generated) goes to the prefix cache
        first (a scoring row's never: scoring needs the logits of every position anyway)."""
        self._check_row(row, scoring=True)
        held = self._row_tokens[row]
        if held and self.prefix_cache.enabled and row < self.rows:
            keys, values = self._store.read_row(row, len(held))
            self.prefix_cache.insert(held, keys, values)
        self._row_tokens[row] = []
        self._ahead[row] = 0
        self._epoch[row] += 1
        self._states.clear_row(row)
        self._serial_cache = None
        if not any(self._row_tokens):
            self._store.clear()  # idle: give the KV memory back
            mx.clear_cache()

    def thread_exit(self) -> None:
        """The thread driving the engine ends: free its CPU streams (see cpu_kernels); the
        prefix cache's entries go to its disk tier, if it has one."""
        self.prefix_cache.persist()
        cpu_kernels.release_streams()

    def cached_tokens(self, row: int) -> int:
        """Prompt tokens of the row's last prefill that came from the prefix cache."""
        return self.row_cached[row]

    def weight_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def prefill(self, row: int, tokens: Sequence[int]) -> np.ndarray:
        self._check_row(row)
        n = len(tokens)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if n > self.context_length:
            raise ValueError(f"prompt of {n} tokens exceeds the context of {self.context_length}")
        if self._ahead[row]:
            raise RuntimeError(f"row {row} has a decode step in flight; release it first")
        tokens = [int(t) for t in tokens]
        reused = self._open(row, tokens)
        logits = None
        for start in range(reused, n, PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            try:
                logits = self._run_groups([([row], [start], [chunk])])
            except Exception as exc:  # noqa: BLE001 - surfaced as an engine error for isolation
                raise EngineError(f"forward failed: {exc}") from exc
            self._row_tokens[row].extend(chunk)
        return logits[0]

    @property
    def shared_prefix_min(self) -> int:
        """The shortest prefix a fresh row copies from another row (0: no prefix reuse)."""
        return self.prefix_cache.min_tokens if self.prefix_cache.enabled else 0

    def _open(self, row: int, tokens: list[int]) -> int:
        """Reset `row` for a new prompt and copy in the longest prefix held elsewhere (prefix
        cache, or a running row); returns the positions reused (the row's cursor)."""
        self._states.clear_row(row)
        if self.serial_reason is not None:
            self._serial_cache = make_cache(self.model)
        source, shared = self._live_prefix(row, tokens)
        entry, reused = self.prefix_cache.match(tokens, floor=shared)
        if shared > reused:  # a running row holds more of this prompt than the cache
            keys, values = self._store.read_row(source, shared)
            self._store.write_prefix(row, keys, values, shared)
            reused = shared
        elif entry is not None:
            self._store.write_prefix(row, entry.keys, entry.values, reused)
        self.prefix_cache.record(reused)
        self._row_tokens[row] = tokens[:reused]
        self.row_cached[row] = reused
        return reused

    def _live_prefix(self, row: int, tokens: list[int]) -> tuple[int, int]:
        """The other row holding the longest prefix of `tokens` (all but the last) and its
        length: the choices of an `n` > 1 request, or prompts sharing a system prompt, sent
        together. (0, 0) when none shares at least the prefix cache's minimum."""
        best_row, best = 0, 0
        if not self.prefix_cache.enabled:
            return best_row, best
        query = np.asarray(tokens[:-1], dtype=np.int64)
        for r, held in enumerate(self._row_tokens[: self.rows]):
            n = min(len(held), query.size)
            if r == row or n <= max(best, self.prefix_cache.min_tokens - 1):
                continue
            differ = np.flatnonzero(np.asarray(held[:n], dtype=np.int64) != query[:n])
            length = int(differ[0]) if differ.size else n
            if length > best and length >= self.prefix_cache.min_tokens:
                best_row, best = r, length
        return best_row, best

    def kv_bytes(self) -> int:
        """Bytes held by the decode rows: KV store and recurrent states (or mlx-lm's caches)."""
        return sum(a.nbytes for a in self._held())

    def _held(self) -> list[mx.array]:
        """Every array the rows keep between forwards (evaluated with each step)."""
        if self._serial_cache is not None:
            from mlx.utils import tree_flatten

            leaves = tree_flatten([c.state for c in self._serial_cache])
            return [a for _, a in leaves if isinstance(a, mx.array)]
        return self._store.arrays() + self._states.arrays()

    def _split(self, positions: int) -> bool:
        """Whether a forward over `positions` (rows x new tokens) splits its products in halves
        across two CPU streams, each on one BLIS thread.

        Measured on 2 cores with SmolLM2: a 4-row decode step 61 -> 52 ms and a 20-token prefill
        116 -> 94 ms (BLIS forks both cores for every product, tiny attention products too);
        from a few hundred positions BLIS's own threading wins again.
        """
        if self._fused is None or not self.kernels.split_products or self.dtype != "float32":
            return False
        if skinny.loaded():
            return False  # the skinny library threads the products itself (blas.py)
        if positions <= cpu_kernels.SPLIT_MAX_ROWS:
            return True  # BLIS runs a 1-2 row product on one core whatever its thread count
        return blas.threads_settable() and positions <= SPLIT_MAX_POSITIONS

    def _check_row(self, row: int, scoring: bool = False) -> None:
        """A serving row (`scoring`: or one of the scoring rows after them)."""
        last = self.rows + (self.score_rows if scoring else 0) - 1
        if not 0 <= row <= last:
            raise ValueError(f"row {row} out of range 0..{last}")

    def _graph(
        self, rows: list[int], starts: list[int], ids: mx.array, split: bool, every: bool = False
    ) -> mx.array:
        """The (lazy) logits [B, vocab] float32 of each row's last position for ids [B, q]
        (`every`: of each position of the one row, [q, vocab]; see `speculative`)."""
        if every:
            plan = self._forward_plan(rows, starts, ids.shape[1])
            views = row_views(self._layout, self._store, self._states, plan)
            hidden = self.model.model(ids, cache=views)[0]
            head = cpu_kernels.lm_head(self.model, hidden, self.kernels.split_products)
            return head.astype(mx.float32)
        if self._serial_cache is not None:  # one row on mlx-lm's own caches
            return last_logits(self.model, self._inner, ids, self._serial_cache).astype(mx.float32)
        plan = self._forward_plan(rows, starts, ids.shape[1])
        views = row_views(self._layout, self._store, self._states, plan)
        if self._fused is not None:
            logits = self._fused.logits(ids, views, split=split)
        elif self._plain_head:
            hidden = self.model.model(ids, cache=views)[:, -1, :]
            logits = cpu_kernels.lm_head(self.model, hidden, self.kernels.split_products)
        else:  # the model's own head: soft-capping, scaled or tied embeddings...
            logits = last_logits(self.model, self._inner, ids, views)
        return logits.astype(mx.float32)

    def _forward_plan(self, rows: list[int], starts: list[int], q: int) -> ForwardPlan:
        kv_len = max(starts) + q
        self._store.ensure_rows(max(rows) + 1)  # a scoring row allocates the scoring rows
        self._store.ensure(kv_len)
        return ForwardPlan(
            rows=rows,
            starts=starts,
            length=q,
            mask=row_mask(starts, q, kv_len),
            kv_len=kv_len,
            all_rows=rows == list(range(self._store.rows)),
            group_axis=self._grouped_scores,
        )
