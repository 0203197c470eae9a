"""MLX engine: mlx-lm model classes driven through a row-addressed KV cache.

`MLXEngine` loads the model once (sharding, quantization, the kernel set, the fused forward)
and composes the parts that run it, each owning one thing:
- `RowTable` (mlx_rows.py): rows, cursors, their KV store, recurrent states, prefix cache;
- `ModelForward` (mlx_forward.py): groups of rows at their cursors -> logits, through
  `FusedForward` or mlx-lm's model;
- `StepExecutor` (mlx_steps.py): a `StepPlan` (decode rows, prompt and scoring chunks) -> one
  forward -> a `StepResult`; whole prompts (`prefill`);
- `DecodePipeline` (mlx_decode.py): decode steps started now and finished later (pipelining);
- `ScoreSession`, `EmbedSession` (mlx_sessions.py): batches on caches of their own.
The engine's methods are the contract of engines/contract.py, each handed to the part that owns it.
Sliding-window layers get a per-row window mask, recurrent layers a per-row state slot (see
layout.py); a model whose caches cannot be held per row is served on one row through mlx-lm's
own caches (`serial_reason` says why).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from llm_server.engines.contract import EngineError
from llm_server.engines.forward.fused import FusedForward
from llm_server.engines.forward.kernels import resolve as resolve_kernels
from llm_server.engines.forward.model import ModelForward
from llm_server.engines.kv.budget import HeldBytes
from llm_server.engines.kv.format import KVFormat, bytes_per_element
from llm_server.engines.kv.prefix_cache import PrefixCache, default_bound, kv_token_bytes
from llm_server.engines.kv.prefix_disk import (
    DiskTier,
    checkpoint_digest,
    default_disk_bytes,
    engine_fingerprint,
)
from llm_server.engines.kv.rows import RowTable
from llm_server.engines.kv.state import StateStore
from llm_server.engines.kv.store import RowStore
from llm_server.engines.mlx import quantized
from llm_server.engines.mlx.bare_checkpoint import model_classes
from llm_server.engines.mlx.decode import DecodePipeline, DecodeStep
from llm_server.engines.mlx.dtypes import checkpoint_dtype, default_dtype
from llm_server.engines.mlx.executor import StepExecutor
from llm_server.engines.mlx.layout import (
    GROUPED_SCORE_MODULES,
    KV,
    PLAIN_HEAD_MODULES,
    cache_layout,
    check_model_type,
    inner_name,
    kv_heads,
    make_cache,
    model_family,
)
from llm_server.engines.mlx.selfcheck import VERIFIED_FAMILIES, row_forward_problem
from llm_server.engines.mlx.sessions import EmbedSession, ScoreSession, all_position_logits
from llm_server.engines.mlx.vlm_checkpoint import is_vlm, text_config
from llm_server.engines.plan import (
    EmbeddingSpan,
    ScoreChunkResult,
    StepPlan,
    StepResult,
    check_spans,
)
from llm_server.engines.probe import supports_batching
from llm_server.engines.settings import EngineSettings

log = logging.getLogger(__name__)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class MLXEngine:
    """Engine protocol implementation on MLX (Metal on a Mac, the CPU on Linux)."""

    name = "mlx"
    dynamic_shapes = True
    no_embeddings = None  # embed_begin/embed_chunk/embed_end are served (EmbedSession)

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
        self.kernels = ks = resolve_kernels(settings.kernels)
        self.dtype = settings.dtype or default_dtype(path)  # engines/mlx/dtypes.py
        self.kv_format = _kv_format(settings, self.dtype, path)
        self._kv_settings = (settings.kv_dtype, settings.kv_bits, settings.kv_group_size)
        config = json.loads((path / "config.json").read_text())
        check_model_type(config)
        # multimodal configs nest the LM's (a VLM's: as its text family reads it)
        text = (
            text_config(config) if is_vlm(config) else {**config, **config.get("text_config", {})}
        )
        # bare-transformer checkpoints (embedding models) load too; see bare_checkpoint
        self.model, self.config = load_model(path, lazy=True, get_model_classes=model_classes)
        # this rank's layers when split pipeline-parallel (a pipeline.Stage); the fused
        # forward, pipelining and scoring rows do not compose with sharding
        sharded = settings.sharded
        self.stage = _shard(self.model, settings, text, config["model_type"]) if sharded else None
        self.has_lm_head = getattr(self.model, "has_lm_head", True)
        self.quantized = quantized.prepare(self.model, settings.keep_quantized, ks.dequantize)
        self.model.set_dtype(_DTYPES[self.dtype])
        max_pos = int(text.get("max_position_embeddings") or 2048)
        self.context_length = min(settings.context_length or max_pos, max_pos)
        self.layout = cache_layout(self.model)
        self.model_type = str(config["model_type"])
        # why this model serves one request at a time (None: its rows batch)
        self.serial_reason: str | None = None
        if self.layout.serial_reason is not None:
            self.serial_reason = f"{self.model_type}: {self.layout.serial_reason}"
        self._inner = inner_name(self.model)
        self._plain_head = model_family(self.model) in PLAIN_HEAD_MODULES
        self._grouped_scores = model_family(self.model) in GROUPED_SCORE_MODULES
        self.fused = self._build_fused(settings.fused_decode and not sharded, settings)
        mx.eval(self.model.parameters())
        mx.clear_cache()  # the buffers freed while stacking
        self._weights = self.weight_bytes()  # counted by the memory budget (held_bytes)
        self._account = settings.budget  # engines/kv/budget.py Account (None: no budget)
        if self._account is not None and self._account.room(self._weights) < 0:
            raise self._account.refused("the weights", self._weights)
        # the set's attention/SwiGLU in mlx-lm's modules (linux_cpu: and, where mlx-lm's forward
        # runs the layers with a plain head, its 1-2 row products on both cores)
        ks.functions.prepare_mlx_lm(self.model, self.fused is None and self._plain_head)
        self.model_path = path
        pipeline = ks.pipeline if settings.pipeline is None else settings.pipeline
        self._pipeline = pipeline and not sharded
        self.padded_shapes = settings.padded_shapes
        self.vocab_size = int(text["vocab_size"])
        self.hidden_size = int(text.get("hidden_size") or 0)  # an embedding span's width
        self.num_layers = len(self.layout.leaves)  # caches of the model's cache list
        # per store slot (kv heads, k_dim, v_dim), None for a state: what the KV format
        # encodes and what a position costs (None: a model mlx-lm's caches do not show)
        self._kv_heads = None if sharded or self.serial_reason else kv_heads(self.model)
        # the prefix cache evicts by bytes, from the config: every rank of a sharded model
        # counts the same (the heads split evenly, a pipeline stage counts the whole model's)
        bound = settings.prefix_cache_bytes
        if bound is None:
            bound = default_bound(self.kv_format.config_token_bytes(text))
        self._prefix_cache_bytes = bound
        self._score_rows = 0 if sharded else settings.score_rows
        self._keep_alive = 0.0 if sharded else settings.kv_keep_alive  # (no rank trims)
        self._compose_checked(rows)
        per_token = self.kv_token_bytes()
        if per_token is not None:
            log.info("KV: %d bytes per token (%s)", per_token, self.kv_format.name)
        self._resume(settings)

    def _compose_checked(self, rows: int) -> None:
        """`_compose`, after checking an architecture the tests do not cover against mlx-lm's
        own forward (on failure: one row, `serial_reason` says why). The check runs with the
        KV as computed: a format's rounding is not the row forward's fault. A model served on
        mlx-lm's own caches keeps its KV in the compute dtype, whatever format was asked."""
        if self.serial_reason is None and model_family(self.model) not in VERIFIED_FAMILIES:
            asked, self.kv_format = self.kv_format, KVFormat(self.dtype, self.dtype)
            self._compose(rows)
            problem = row_forward_problem(self)
            self.kv_format = asked
            if problem is not None:
                self.serial_reason = f"{self.model_type}: {problem}"
                rows = 1
        if self.serial_reason is not None and not self.kv_format.identity:
            log.warning(
                "%s is served on mlx-lm's own caches: KV in %s, not %s",
                self.model_type, self.dtype, self.kv_format.name,
            )  # fmt: skip
            self.kv_format = KVFormat(self.dtype, self.dtype)
        self._compose(rows)  # (after a check: its rows and prefix cache forgotten)

    def _compose(self, rows: int) -> None:
        """Empty rows (`rows` of them, 1 when serving serially), the prefix cache, and the
        parts that run them."""
        serial = self.serial_reason is not None
        self.rows = 1 if serial else rows
        # a recurrent state cannot be cut back: a step is never started before the last one
        # finished (a cancelled early step would have advanced it), a prefix is reused only
        # from a state checkpoint (kv/rows.py), and a draft's rejected tail is dropped by
        # restoring the state from before the step and running the kept positions again
        # (StepExecutor.rewind)
        stateful = self.layout.stateful
        self.pipelined = self._pipeline and not (stateful or serial)
        # logits at every position: the fused forward, a plain head, or (hybrids, whose
        # families the tests cover) the model's own head over every position
        all_positions = not serial and (self.fused is not None or self._plain_head or stateful)
        # drafts can be verified and rejected positions dropped
        self.speculative = all_positions
        # scoring rows need logits at every position; a stateful one's slot is cleared when
        # a chunk opens it and carried across its chunks
        self.score_rows = self._score_rows if all_positions else 0
        total = self.rows + self.score_rows  # store rows: the serving rows, then scoring rows
        states = [(i, c.size) for i, c in enumerate(self.layout.leaves) if c.kind != KV]
        store = RowStore(
            self.num_layers, total, self.context_length, first_rows=self.rows,
            kv_format=self.kv_format,
        )  # fmt: skip
        if self._kv_heads is not None:
            store.dims = [None if h is None else h[1:] for h in self._kv_heads]
        self.row_table = RowTable(
            store,
            StateStore([i for i, _ in states], total, [n for _, n in states]),
            PrefixCache(
                0 if serial else self._prefix_cache_bytes,
                layers=self._counted_layers(),
                stateful=self.layout.stateful,
            ),
            self.rows,
            self.score_rows,
            serial_cache=(lambda: make_cache(self.model)) if serial else None,
            keep_alive=self._keep_alive,
        )
        self._attach_budget()
        self.forward = ModelForward(
            self.model,
            self.layout,
            self.row_table,
            self.kernels,
            self.fused,
            dtype=self.dtype,
            inner=self._inner,
            plain_head=self._plain_head,
            grouped_scores=self._grouped_scores,
            stage=self.stage,
        )
        self.decoder = DecodePipeline(self.row_table, self.forward, self.context_length)
        self.executor = StepExecutor(
            self.row_table,
            self.forward,
            self.decoder,
            self.kernels,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            speculative=self.speculative,
            model_type=self.model_type,
        )
        self.scoring = ScoreSession(self.forward, self.kernels)
        self.embedding = EmbedSession(
            self.model,
            self._inner,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            name=self.model_type,
        )

    def _resume(self, settings: EngineSettings) -> None:
        """Attach the prefix cache's disk tier (`prefix_cache_dir`) and read its most recent
        conversations back into the rows, then prefill each warm prompt on a free row and
        release it: its KV stays in the row, and goes to the prefix cache when the row is
        needed or the store given back (mlx_rows)."""
        prompts = settings.warm_tokens
        if settings.prefix_cache_dir is None and not prompts:
            return
        cache = self.prefix_cache
        if settings.group is not None or not cache.enabled:
            log.warning("prefix cache off for this model: --prefix-cache-dir/--warm-prompts unused")
            return
        if settings.prefix_cache_dir is not None:
            folder = Path(settings.prefix_cache_dir)
            bound = settings.prefix_cache_disk_bytes
            bound = default_disk_bytes(folder) if bound is None else bound
            kv = "" if self.kv_format.identity else self.kv_format.name
            tier = DiskTier(folder, bound, self.kv_fingerprint(), cache.min_tokens, kv)
            cache.attach_disk(tier)
            resumed = self.row_table.resume()
            if resumed:
                log.info("resumed %d conversation(s) from %s into the KV store", resumed, folder)
        for ids in prompts:
            ids = list(ids[: self.context_length])
            if len(ids) >= cache.min_tokens:
                row = self.preferred_row(ids, list(range(self.rows)))  # not over a resumed one
                self.prefill(row, ids)
                self.release(row)
        if prompts:
            log.info("prefilled %d warm prompts into the prefix cache", len(prompts))

    def kv_fingerprint(self) -> str:
        """The disk tier's key for this engine's KV (prefix_disk.engine_fingerprint)."""
        return engine_fingerprint(
            checkpoint_digest(self.model_path),
            self.dtype,
            self.kernels.name,
            fused=self.fused is not None,
            quantized=self.quantized,
            state_layout=self.state_layout(),
            kv_format="" if self.kv_format.identity else self.kv_format.name,
        )

    def state_layout(self) -> str:
        """What a state checkpoint holds: each recurrent layer's index and arrays ("": none)."""
        leaves = self.layout.leaves
        return ",".join(f"{i}:{c.size}" for i, c in enumerate(leaves) if c.kind != KV)

    def _build_fused(self, wanted: bool, settings: EngineSettings) -> FusedForward | None:
        """Steps with stacked q/k/v and gate/up products (None: mlx-lm's forward). Built while
        the weights are still lazy, so the separate ones only ever exist one layer at a time:
        stacking loaded weights instead left ~280 MB of freed (but resident) heap."""
        fusable = wanted and self._plain_head and self.layout.plain
        if not fusable or self.serial_reason is not None:
            return None
        fused = FusedForward.build(self.model, self.context_length, self.kernels)
        if fused is not None and not self.kv_format.identity:
            # the set's native attention (linux_cpu's decode ops) reads float32 stores only:
            # another format attends through MLX ops over the decoded KV, chosen here
            fused.use_table(fused.table, native=False)
        compiled = settings.compiled_decode
        if compiled is None:
            compiled = self.kernels.compiled_decode
        if compiled and fused is not None:
            fused.enable_compiled()
        return fused

    def _counted_layers(self) -> tuple[int, int]:
        """(layers the prefix cache counts bytes for, layers this rank holds): a pipeline
        stage counts the whole model's, so every rank evicts the same entries."""
        if self.stage is None:
            return (1, 1)
        return (self.stage.total, len(self.stage.layers))

    # -- rows and cursors (RowTable) --------------------------------------------------

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.row_table.prefix_cache

    @property
    def kernels_name(self) -> str:
        return self.kernels.name

    @property
    def kv_format_name(self) -> str:
        return self.kv_format.name

    def group_status(self) -> None:
        return None  # not split over ranks (LockstepEngine reports a group's)

    @property
    def shared_prefix_min(self) -> int:
        """The shortest prefix a fresh row copies from another row (0: no prefix reuse)."""
        return self.prefix_cache.min_tokens if self.prefix_cache.enabled else 0

    def cursor(self, row: int) -> int:
        return self.row_table.cursor(row)

    def cached_tokens(self, row: int) -> int:
        """Prompt tokens of the row's last prefill that came from the prefix cache."""
        return self.row_table.cached_tokens(row)

    def release(self, row: int) -> None:
        """Free `row` (a serving row keeps its history in place for the next turn)."""
        self.row_table.release(row)

    def preferred_row(self, tokens: list[int], rows: list[int]) -> int:
        """The free row to open `tokens` on: the one still holding the longest prefix of it."""
        return self.row_table.preferred_row(tokens, rows)

    def idle_due(self) -> float | None:
        """Seconds until the idle KV store is given back (None: none held idle)."""
        return self.row_table.idle_due()

    def trim_idle(self, force: bool = False) -> bool:
        """Give the idle KV store back once its keep-alive is over (now, with `force`)."""
        return self.row_table.trim_idle(force)

    def rewind(self, row: int, cursor: int) -> None:
        """Drop `row`'s positions from `cursor` on (a draft's rejected tokens)."""
        self.row_table.check_row(row)
        if not self.speculative:
            raise EngineError(f"{self.model_type}: a row cannot be rewound")
        self.executor.rewind(row, cursor)

    def kv_token_bytes(self) -> int | None:
        """KV bytes one position of one row takes in every layer, in the store's format
        (None: not known, e.g. a model served through mlx-lm's own caches)."""
        if self._kv_heads is None:
            return None
        heads = [h for h in self._kv_heads if h is not None]
        return self.row_table.store.bytes_per_token(heads)

    def kv_bytes(self) -> int:
        """Bytes held by the decode rows: KV store and recurrent states (or mlx-lm's caches)."""
        return sum(a.nbytes for a in self.row_table.held())

    def _attach_budget(self) -> None:
        """Have every growth of the KV store and every prefix-cache entry ask the memory
        budget first; the budget measures this engine's arrays (`held_bytes`)."""
        account = self._account
        if account is None:
            return
        store = self.row_table.store
        store.budget, store.position_bytes = account, self.kv_bytes_for(1) - self.kv_bytes_for(0)
        self.prefix_cache.budget = account
        account.measure = self.held_bytes
        account.shrink = self.prefix_cache.shrink

    def held_bytes(self) -> HeldBytes:
        """Bytes held now: weights, KV (store rows and states, or a serial model's mlx-lm
        caches at their capacity), prefix cache entries. Safe from any thread: it only reads
        the arrays' sizes (no MLX op is built)."""
        table = self.row_table
        if table.serial_cache is None:
            kv = sum(a.nbytes for a in table.store.arrays() + table.states.arrays())
        else:
            from mlx.utils import tree_flatten

            leaves = tree_flatten([vars(c) for c in table.serial_cache])
            kv = sum(a.nbytes for _, a in leaves if isinstance(a, mx.array))
        return HeldBytes(self._weights, kv, self.prefix_cache.bytes)

    def kv_bytes_for(self, positions: int) -> int:
        """Bytes one row holds at `positions` (keys and values of the layers that keep them,
        plus a recurrent model's constant state)."""
        per = self.kv_token_bytes()  # in the store's KV format
        if per is None:  # not known from the layers: from the config, the layers that keep KV
            kv_layers = sum(1 for leaf in self.layout.leaves if leaf.kind == KV)
            text = {**self.config, **self.config.get("text_config", {})}
            width = bytes_per_element(_DTYPES[self.dtype].size, *self._kv_settings)
            per = int(kv_token_bytes(text, width)) * kv_layers
            per //= max(int(text.get("num_hidden_layers") or 1), 1)
        state = sum(a.nbytes for a in self.row_table.states.arrays()) // max(
            self.row_table.states.rows, 1
        )
        return positions * per + state

    def kv_room(self) -> int | None:
        """Bytes of KV and prefix cache the memory budget could ever give this model (None:
        no budget)."""
        return None if self._account is None else self._account.room()

    def budget_bytes(self) -> int | None:
        return None if self._account is None else self._account.budget.limit

    def weight_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def thread_exit(self) -> None:
        """The thread driving the engine ends: its MLX streams finished and freed (the kernel
        set's `thread_exit`); the prefix cache's entries go to its disk tier."""
        self.persist()
        self.kernels.functions.thread_exit()

    def kept_tokens(self) -> int:
        """Positions of released rows' histories held only in their rows (PrefixCacheStats)."""
        return self.row_table.unsaved_tokens()

    def persist(self) -> None:
        """The prefix cache's entries, the rows' kept histories included, to its disk tier
        (if it has one)."""
        if self.prefix_cache.disk is not None:
            self.row_table.save_kept()
            self.prefix_cache.persist()

    # -- steps (StepExecutor, DecodePipeline) ------------------------------------------

    def run(self, plan: StepPlan) -> StepResult:
        return self.executor.run(plan)

    def prefill(
        self, row: int, tokens: Sequence[int], spans: Sequence[EmbeddingSpan] = ()
    ) -> np.ndarray:
        return self.executor.prefill(row, tokens, spans)

    def check_spans(self, length: int, spans: Sequence[EmbeddingSpan]) -> None:
        """Admission of a prompt's embedding spans (engines/contract.py: `Engine.check_spans`)."""
        if spans:
            self.forward.check_inputs()
            check_spans(spans, length, self.hidden_size)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        return self.decoder.decode(rows, tokens)

    def decode_start(self, rows: Sequence[int], tokens: Sequence[int] | mx.array) -> DecodeStep:
        return self.decoder.start(rows, tokens)

    def decode_finish(self, step: DecodeStep) -> np.ndarray:
        return self.decoder.finish(step)

    def decode_cancel(self, step: DecodeStep) -> None:
        self.decoder.cancel(step)

    # -- sessions (ScoreSession, EmbedSession) -----------------------------------------

    def score_begin(self, batch: int) -> None:
        self.scoring.begin(batch)

    def score_chunk(self, tokens: np.ndarray, targets: np.ndarray, top_k: int) -> ScoreChunkResult:
        return self.scoring.chunk(tokens, targets, top_k)

    def score_end(self) -> None:
        self.scoring.end()

    def embed_begin(self, batch: int) -> None:
        self.embedding.begin(batch)

    def embed_chunk(self, tokens: np.ndarray) -> np.ndarray:
        return self.embedding.chunk(tokens)

    def embed_end(self) -> None:
        self.embedding.end()

    def all_position_logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits [N, q, vocab] of a padded batch on a fresh scoring cache (tests, tools)."""
        return all_position_logits(self.model, tokens)


def _kv_format(settings: EngineSettings, dtype: str, path: Path) -> KVFormat:
    """The KV store's format: as asked, else on the CPU the compute dtype, on Metal the
    checkpoint's half dtype (else the compute dtype)."""
    kv_dtype = settings.kv_dtype
    if kv_dtype is None and settings.kv_bits is None and mx.default_device() != mx.cpu:
        kv_dtype = checkpoint_dtype(path)
    return KVFormat.of(dtype, kv_dtype, settings.kv_bits, settings.kv_group_size)


def _shard(model, settings: EngineSettings, text: dict, model_type: str):
    """Split `model` over `settings.group` while its weights are still lazy, so each rank
    materialises its slices only; returns this rank's pipeline stage (None: tensor parallel,
    mlx-lm's `model.shard`)."""
    from llm_server.engines.mlx.pipeline import split_model

    group = settings.group
    if settings.parallel == "pipeline":
        return split_model(model, group)
    if not hasattr(model, "shard"):
        raise ValueError(f"{model_type} has no tensor-parallel shard()")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if int(text.get(key) or 0) % group.size():
            raise ValueError(f"{key}={text[key]} does not split over {group.size()} ranks")
    model.shard(group)
    return None
