"""The served model: tokenizer + scheduler + identity, and the async bridge to the scheduler.

The HTTP layer calls `start_generation()`, which admits the request at once (or raises
QueueFull / SchedulerClosed) and returns a handle whose events arrive on the event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_server.decoding import Decoder, LogitsConstraint, SamplingParams
from llm_server.engines.contract import Engine
from llm_server.engines.kv.budget import format_bytes
from llm_server.engines.plan import EmbeddingSpan
from llm_server.fingerprint import system_fingerprint
from llm_server.generation_config import load_sampling_defaults
from llm_server.pooling import EmbeddingConfig, EmbeddingConfigError, load_embedding_config
from llm_server.scheduler import (
    BatchScheduler,
    FinishEvent,
    GenerationRequest,
    Priority,
    TokenEvent,
)
from llm_server.scheduler.batch import (
    DEFAULT_MEMORY_WAIT_S,
    DEFAULT_PREFILL_TOKENS,
    DEFAULT_SPEC_TOKENS,
    DEFAULT_SPECULATIVE,
    DEFAULT_STEP_TOKENS,
)
from llm_server.scheduler.embedder import Embedder
from llm_server.scheduler.pumps import Pumps
from llm_server.scheduler.request import Event
from llm_server.scheduler.scorer import ScoredPrompt, Scorer
from llm_server.tokenizer import Tokenizer
from llm_server.tools.detect import model_syntax
from llm_server.vision import VisionRenderer, VisionUnavailable, load_vision

log = logging.getLogger(__name__)

# The priority of the generations started in this context: the Batch API's runner sets BATCH
# around the route handler it calls (batch/runner.py), so handlers need not know about batches.
request_priority: contextvars.ContextVar[Priority] = contextvars.ContextVar(
    "request_priority", default=Priority.INTERACTIVE
)


@dataclass(frozen=True)
class ServiceConfig:
    """How the service admits and shapes requests; the engine's own settings (rows, dtype)
    are EngineSettings'."""

    model_id: str = ""  # the id /v1/models reports ("": the model folder's name)
    aliases: tuple[str, ...] = ()  # other names requests may use (a registry entry's aliases)
    max_queued: int = 16
    default_max_tokens: int = 512
    constrained_mode: str = "batched"  # "batched" | "exclusive" (each alone, the batch waits)
    chat_template: str | None = None  # overrides the checkpoint's (--chat-template FILE)
    tool_parser: str | None = None  # --tool-parser; None: detected from the chat template
    pooling: str | None = None  # "last" | "mean" | "cls": overrides the checkpoint's pooling
    step_tokens: int = DEFAULT_STEP_TOKENS  # positions per forward (--step-tokens; 0: no limit)
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS  # ... when no row decodes (--prefill-tokens)
    speculative: str = DEFAULT_SPECULATIVE  # --speculative: "ngram" | "off"
    spec_tokens: int = DEFAULT_SPEC_TOKENS  # --spec-tokens: most draft ids per row and step
    batch_share: bool = False  # --batch-share: batch lines decode beside interactive ones (S11)
    # seconds a request whose prompt's KV the memory budget refuses waits for room (queued,
    # holding no row) before its 503 with Retry-After (scheduler/batch.py `_park`)
    memory_wait: float = DEFAULT_MEMORY_WAIT_S


class EmbeddingsUnavailable(RuntimeError):
    """The served model cannot embed (its pooling files ask for what is not served)."""


class GenerationHandle:
    """One admitted request as seen from the event loop."""

    def __init__(self, request: GenerationRequest, queue: asyncio.Queue[Event]) -> None:
        self.request = request
        self._queue = queue
        self.finish: FinishEvent | None = None

    async def events(self) -> AsyncIterator[Event]:
        """Yield TokenEvents then one FinishEvent; cancels the request if abandoned."""
        try:
            while True:
                ev = await self._queue.get()
                if isinstance(ev, FinishEvent):
                    self.finish = ev
                    yield ev
                    return
                yield ev
        finally:
            if self.finish is None:
                self.request.cancel()

    def cancel(self) -> None:
        self.request.cancel()


class ModelService:
    """Everything the handlers need about the one served model."""

    def __init__(
        self,
        model_path: Path,
        config: ServiceConfig,
        rows: int,
        engine_factory: Callable[[], Engine],
        on_step: Callable[[float, int], None] | None = None,
    ) -> None:
        """`model_path`: the tokenizer's folder; `rows`: the requests decoded together (the
        engine may serve fewer: BatchScheduler.load decides, S1)."""
        self.config = config
        self.tokenizer = Tokenizer(model_path, chat_template=config.chat_template)
        # what a request that omits temperature/top_p gets (the checkpoint's generation_config)
        self.sampling_defaults = load_sampling_defaults(model_path)
        self.syntax = model_syntax(
            self.tokenizer.template_source, _TokenLookup(self.tokenizer.hf), config.tool_parser
        )
        self.scheduler = BatchScheduler(
            engine_factory,
            max_concurrent=rows,
            max_queued=config.max_queued,
            on_step=on_step,
            step_tokens=config.step_tokens,
            prefill_tokens=config.prefill_tokens,
            speculative=config.speculative,
            spec_tokens=config.spec_tokens,
            batch_share=config.batch_share,
            memory_wait=config.memory_wait,
        )
        # Scoring rides in the step plans on the engine's scoring rows, or (the fallback) runs
        # between steps on its separate session, a pump (C1; Scorer.attach chooses).
        pump_queued = rows + config.max_queued  # requests per pump
        self.scorer = Scorer(wake=self.scheduler.wake, max_queued=pump_queued)
        self.scheduler.scorer = self.scorer
        # Embeddings run the same way, on their own session; the two pumps take turns.
        self.embedding: EmbeddingConfig | None = None
        self.embedding_error: str | None = None  # why embeddings are refused, if they are
        try:
            self.embedding = load_embedding_config(model_path, config.pooling)
        except EmbeddingConfigError as exc:
            self.embedding_error = str(exc)
            log.warning("embeddings are off for this model: %s", exc)
        pumps: list = [self.scorer.session]
        self.embedder: Embedder | None = None
        if self.embedding is not None:
            self.embedder = Embedder(
                self.embedding, wake=self.scheduler.wake, max_queued=pump_queued
            )
            pumps.append(self.embedder)
        self.scheduler.pump = Pumps(pumps)
        # a vision-language checkpoint's images: its tower, projector and processor (None: a
        # text model, or a VLM whose images cannot be served, `vision_error` says why)
        self.vision: VisionRenderer | None = None
        self.vision_error: str | None = None
        try:
            self.vision = load_vision(model_path, self.tokenizer)
        except VisionUnavailable as exc:
            self.vision_error = str(exc)
            log.warning("images are off for this model: %s", exc)
        self.started_at = time.time()
        self.engine: Engine | None = None
        self.fingerprint = ""
        self.batching = False

    def start(self) -> ModelService:
        self.scheduler.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        engine = self.scheduler.wait_ready(timeout)
        self.engine = engine
        self.batching = self.scheduler.max_concurrent > 1
        # a KV format other than the compute dtype changes outputs: it is in the descriptor (S9)
        kv = engine.kv_format_name
        dtype = engine.dtype if kv in (None, engine.dtype) else f"{engine.dtype};kv={kv}"
        self.fingerprint = system_fingerprint(
            self.config.model_id, engine.name, dtype, self.scheduler.max_concurrent
        )

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def context_length(self) -> int:
        assert self.engine is not None
        return self.engine.context_length

    def start_generation(
        self,
        prompt: list[int],
        params: SamplingParams,
        constraint: LogitsConstraint | None = None,
        keep_tokens: frozenset[int] = frozenset(),
        embeddings: tuple[EmbeddingSpan, ...] = (),
    ) -> GenerationHandle:
        """Admit a request now (raises QueueFull/SchedulerClosed) and return its handle.

        `keep_tokens`: special tokens to keep in the text (tool-call markers such as
        [TOOL_CALLS]); every other special token is skipped. `embeddings`: input embeddings
        at prompt positions (engines/plan.py: `EmbeddingSpan`; the prompt holds placeholder
        ids there); EmbeddingInputUnsupported when the model's forward cannot take them,
        ValueError when they do not fit the prompt.
        """
        return self.start_generations(
            [prompt], [params], [constraint], keep_tokens, embeddings=[embeddings]
        )[0]

    def memory_refusal(self, positions: int) -> str | None:
        """Why a row of `positions` (a prompt and its max_tokens) could never fit the memory
        budget, whatever is evicted (None: it could, or there is no budget)."""
        engine = self.engine
        room = None if engine is None else engine.kv_room()
        if room is None:
            return None
        need = engine.kv_bytes_for(positions)
        if need <= room:
            return None
        return (
            f"this request's KV at {positions} positions (its prompt and max_tokens) needs "
            f"{format_bytes(need)} ({need} bytes) but model {self.config.model_id!r} can hold "
            f"at most {format_bytes(max(room, 0))} ({max(room, 0)} bytes) of KV within the "
            "memory budget beside its weights and the pinned models; shorten the prompt or "
            "max_tokens, or raise --max-memory"
        )

    def start_generations(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        constraints: list[LogitsConstraint | None] | None = None,
        keep_tokens: frozenset[int] = frozenset(),
        prediction: tuple[int, ...] | None = None,
        embeddings: list[tuple[EmbeddingSpan, ...]] | None = None,
    ) -> list[GenerationHandle]:
        """Admit one generation per prompt, all or none (QueueFull/SchedulerClosed); one
        handle per prompt, in order. `params[i]`, `constraints[i]` and `embeddings[i]` go
        with `prompts[i]`; `prediction`: token ids each output is expected to repeat (a
        drafting source)."""
        loop = asyncio.get_running_loop()
        eos = self.tokenizer.eos_token_ids
        constraints = constraints or [None] * len(prompts)
        spans = embeddings or [()] * len(prompts)
        detokenize = self.tokenizer.decoder_keeping(keep_tokens)
        priority = request_priority.get()
        reqs, handles = [], []
        for prompt, sp, constraint, spans_i in zip(
            prompts, params, constraints, spans, strict=True
        ):
            queue: asyncio.Queue[Event] = asyncio.Queue()
            decoder = Decoder(sp, eos, detokenize, constraint, prompt)
            exclusive = constraint is not None and self.config.constrained_mode == "exclusive"
            req = GenerationRequest(
                prompt=prompt,
                decoder=decoder,
                emit=_emitter(loop, queue),
                exclusive=exclusive,
                prediction=prediction,
                embeddings=tuple(spans_i),
                priority=priority,
            )
            reqs.append(req)
            handles.append(GenerationHandle(req, queue))
        self.scheduler.submit_all(reqs)
        return handles

    @property
    def capacity(self) -> int:
        """Generations the scheduler holds at once, running plus queued."""
        return self.scheduler.max_concurrent + self.scheduler.max_queued

    @property
    def token_id_limit(self) -> int:
        """Token ids below this are valid in a request (the tokenizer's and the logits')."""
        vocab = self.tokenizer.vocab_size
        return min(vocab, self.engine.vocab_size) if self.engine is not None else vocab

    async def score(
        self, prompts: list[list[int]], top_k: int, generate_one: bool
    ) -> list[ScoredPrompt]:
        """Score every prompt together (C1); returns one ScoredPrompt per prompt, in order.

        Raises ValueError (empty or too long prompt, bad top_k), QueueFull, SchedulerClosed,
        or ScoringError when the engine failed on this request's batch.
        """
        req = self.scorer.submit(prompts, top_k, generate_one, self.context_length)
        return await asyncio.wrap_future(req.future)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled vectors [len(inputs), hidden] float32, every input batched together.

        Raises EmbeddingsUnavailable, QueueFull, SchedulerClosed, or EmbeddingError when the
        engine failed on this request's batch. Inputs are checked by the caller (non-empty,
        within the context).
        """
        if self.embedder is None:
            raise EmbeddingsUnavailable(self.embedding_error or "embeddings are off")
        req = self.embedder.submit(inputs)
        return await asyncio.wrap_future(req.future)

    def prefix_cache_stats(self):
        """The engine's prefix cache counters (PrefixCacheStats), or None without one."""
        cache = None if self.engine is None else self.engine.prefix_cache
        if cache is None:
            return None
        return dataclasses.replace(cache.stats(), kept_tokens=self.engine.kept_tokens())

    def close(self, timeout: float | None = None) -> bool:
        closed = self.scheduler.close(timeout)
        self.scorer.close()  # fails scoring requests that can no longer run
        if self.embedder is not None:
            self.embedder.close()
        if self.vision is not None:
            self.vision.close()
        return closed


class _TokenLookup:
    """`token in vocab` without building the vocabulary dict: get_vocab() on a 50k-token
    tokenizer holds the GIL for ~0.2 s, a stall of every other model's decode thread while a
    model loads beside them."""

    def __init__(self, hf) -> None:
        self._hf = hf

    def __contains__(self, token: object) -> bool:
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is None or not isinstance(token, str):
            return token in self._hf.get_vocab()
        return backend.token_to_id(token) is not None


def _emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Event]) -> Callable:
    """A scheduler-thread callback that hands events to `queue` on the event loop."""

    def emit(ev: Event) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ev)

    return emit


__all__ = ["GenerationHandle", "ModelService", "ServiceConfig", "TokenEvent", "FinishEvent"]
