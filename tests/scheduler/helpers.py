"""Driving the real BatchScheduler directly (no HTTP) in tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llm_server.decoding import Decoder, FinishReason, SamplingParams
from llm_server.engines.contract import Engine, EngineError
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler import BatchScheduler, FinishEvent, GenerationRequest, TokenEvent
from llm_server.scheduler.batch import (
    DEFAULT_PREFILL_TOKENS,
    DEFAULT_SPECULATIVE,
    DEFAULT_STEP_TOKENS,
)
from llm_server.tokenizer import Tokenizer


@dataclass
class Outcome:
    """Everything one request produced."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishEvent | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def emit(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens.append(ev.token_id)
            self.text += ev.text
        else:
            self.finish = ev
            self.done.set()

    def wait_first_token(self) -> None:
        """Block until the request has a token or has finished."""
        while not self.tokens and not self.done.is_set():
            self.done.wait(0.005)

    @property
    def reason(self) -> FinishReason | None:
        return None if self.finish is None else self.finish.reason


def make_request(
    tok: Tokenizer, prompt: list[int], max_tokens: int, **params
) -> tuple[GenerationRequest, Outcome]:
    out = Outcome()
    sp = SamplingParams(max_tokens=max_tokens, temperature=params.pop("temperature", 0.0), **params)
    decoder = Decoder(sp, tok.eos_token_ids, tok.decode)
    return GenerationRequest(prompt=prompt, decoder=decoder, emit=out.emit), out


def start_scheduler(
    model: Path,
    concurrent: int,
    max_queued: int = 64,
    engine_cls=MLXEngine,
    *,
    step_tokens: int = DEFAULT_STEP_TOKENS,
    speculative: str = DEFAULT_SPECULATIVE,
    prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
    **kw,
):
    sched = BatchScheduler(
        lambda: engine_cls(model, EngineSettings(rows=concurrent, **kw)),
        max_concurrent=concurrent,
        max_queued=max_queued,
        step_tokens=step_tokens,
        speculative=speculative,
        prefill_tokens=prefill_tokens,
    ).start()
    sched.wait_ready(60)
    return sched


def serve_together(
    engine_factory: Callable[[], Engine],
    reqs: list[tuple[GenerationRequest, Outcome]],
    hook: Callable | None = None,
    timeout: float = 60.0,
    **sched_kw,
) -> BatchScheduler:
    """Serve (request, outcome) pairs admitted together, drafts from `hook`; the scheduler, closed."""
    sched = BatchScheduler(engine_factory, **sched_kw).start()
    sched.wait_ready(60)
    sched.draft_hook = hook
    try:
        sched.submit_all([req for req, _ in reqs])  # admitted together: same steps every run
        for _, out in reqs:
            assert out.done.wait(timeout)
    finally:
        sched.close(10)
    return sched


def serve_alone(
    model: Path, tok: Tokenizer, prompt: list[int], max_tokens: int, **params
) -> Outcome:
    sched = start_scheduler(model, 1)
    try:
        req, out = make_request(tok, prompt, max_tokens, **params)
        sched.submit(req)
        assert out.done.wait(60)
        return out
    finally:
        sched.close(10)


class PoisonEngine(MLXEngine):
    """A real engine whose decode steps fail while they include a row whose prompt began with
    POISON (the row stays poisoned from its first chunk until it is released)."""

    POISON = 13
    MESSAGE = "simulated out-of-memory in the forward"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.poisoned: set[int] = set()

    def prefill(self, row, tokens):
        if tokens[0] == self.POISON:
            self.poisoned.add(row)
        return super().prefill(row, tokens)

    def run(self, plan):
        for chunk in plan.prefill:
            if chunk.fresh and chunk.prompt[0] == self.POISON:
                self.poisoned.add(chunk.row)
        if self.poisoned & {d.row for d in plan.decode}:
            raise EngineError(self.MESSAGE)
        return super().run(plan)

    def decode_start(self, rows, tokens):
        if self.poisoned & set(rows):
            raise EngineError(self.MESSAGE)
        return super().decode_start(rows, tokens)

    def release(self, row):
        self.poisoned.discard(row)
        super().release(row)
