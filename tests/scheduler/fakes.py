"""A fake engine that executes step plans, and helpers to drive the scheduler's `step()` on it
(no MLX, no threads, no sleeps): tests/scheduler/test_plan.py and test_plan_scoring.py."""

from __future__ import annotations

import numpy as np

from llm_server.decoding import Decoder, SamplingParams
from llm_server.engines.contract import EngineError
from llm_server.engines.plan import ScoreChunkResult, StepPlan, StepResult
from llm_server.scheduler import BatchScheduler, FinishEvent, GenerationRequest, TokenEvent
from llm_server.scheduler.scorer import Scorer

VOCAB = 64
EOS = 0


class FakeEngine:
    """Executes plans over per-row token lists; a row's next-token logits are a function of its
    own history alone, so a request's greedy output does not depend on its neighbours."""

    name = "fake"
    dynamic_shapes = True
    padded_shapes = False
    pipelined = False
    serial_reason = None
    dtype = "float32"
    vocab_size = VOCAB
    has_lm_head = True
    speculative = False  # `run` verifies no drafts
    prefix_cache = None
    kernels_name = None
    kv_format_name = None

    @staticmethod
    def kv_token_bytes() -> None:
        return None

    no_embeddings = "the fake engine does not compute embeddings"

    def __init__(
        self, rows: int, context_length: int = 4096, share_min: int = 0, score_rows: int = 0
    ) -> None:
        self.rows = rows
        self.score_rows = score_rows  # scoring rows after the serving rows
        self.context_length = context_length
        self.shared_prefix_min = share_min
        self.held: list[list[int]] = [[] for _ in range(rows + score_rows)]
        self.plans: list[StepPlan] = []  # every plan run, in order
        self.fail_rows: set[int] = set()  # forwards touching these rows raise

    def run(self, plan: StepPlan) -> StepResult:
        touched = {d.row for d in plan.decode} | {c.row for c in plan.prefill}
        if touched & self.fail_rows or any(c.prompt[0] in self.fail_rows for c in plan.score):
            raise EngineError("simulated failure")
        self.plans.append(plan)
        rows, logits, cursors, cached = [], [], {}, {}
        for d in plan.decode:
            assert self.held[d.row], f"decode on empty row {d.row}"
            self.held[d.row].append(d.token)
            rows.append(d.row)
            logits.append(self._logits(d.row))
        for c in plan.prefill:
            if c.fresh:
                self.held[c.row] = []
                cached[c.row] = 0
            assert len(self.held[c.row]) == c.start
            self.held[c.row] += list(c.prompt[c.start : c.end])
            cursors[c.row] = c.end
            if c.end == len(c.prompt):
                rows.append(c.row)
                logits.append(self._logits(c.row))
        scores = {}
        for c in plan.score:
            assert c.row >= self.rows and (c.start == 0 or len(self.held[c.row]) == c.start)
            self.held[c.row] = self.held[c.row][: c.start] + list(c.prompt[c.start : c.end])
            scores[c.row] = fake_scores(c.prompt, c.start, c.end, c.top_k)
        return StepResult(
            tuple(rows),
            np.array(logits, np.float32).reshape(-1, VOCAB),
            cursors,
            cached,
            scores=scores,
        )

    def _logits(self, row: int) -> np.ndarray:
        h = self.held[row]
        out = np.zeros(VOCAB, np.float32)
        out[1 + (sum(h) * 7 + len(h)) % (VOCAB - 1)] = 1.0  # never EOS
        return out

    def cursor(self, row: int) -> int:
        return len(self.held[row])

    def cached_tokens(self, row: int) -> int:
        return 0

    def release(self, row: int) -> None:
        self.held[row] = []

    def prefill(self, row, tokens):
        self.held[row] = list(tokens)
        return self._logits(row)

    def decode(self, rows, tokens):
        for r, t in zip(rows, tokens, strict=True):
            self.held[r].append(t)
        return np.stack([self._logits(r) for r in rows])

    def thread_exit(self) -> None:
        pass

    def preferred_row(self, tokens: list[int], rows: list[int]) -> int | None:
        return None  # the lowest

    def kept_tokens(self) -> int:
        return 0

    def idle_due(self) -> float | None:
        return None

    def trim_idle(self, force: bool = False) -> bool:
        return False

    def rewind(self, row: int, cursor: int) -> None:
        raise EngineError("the fake engine does not rewind")

    def group_status(self) -> None:
        return None

    def score_begin(self, batch: int) -> None:
        raise EngineError("the fake engine scores on its scoring rows only")

    def score_chunk(self, tokens, targets, top_k: int) -> ScoreChunkResult:
        raise EngineError("the fake engine scores on its scoring rows only")

    def score_end(self) -> None:
        pass

    def embed_begin(self, batch: int) -> None:
        raise EngineError(self.no_embeddings)

    def embed_chunk(self, tokens):
        raise EngineError(self.no_embeddings)

    def embed_end(self) -> None:
        pass


def fake_scores(prompt, start: int, end: int, k: int) -> ScoreChunkResult:
    """Log-probs of positions start..end-1 [1, q], each a function of the prompt up to it."""
    lp = [-((sum(prompt[: i + 1]) * 7 + i) % 13) / 4 for i in range(start, end)]
    ids = [(sum(prompt[: i + 1]) % (VOCAB - 1)) + 1 for i in range(start, end)]
    return ScoreChunkResult(
        token_logprobs=np.array([lp], np.float32),
        top_ids=np.array([[[t] * k for t in ids]], np.int32).reshape(1, end - start, k),
        top_logprobs=np.array([[[v] * k for v in lp]], np.float32).reshape(1, end - start, k),
        greedy_ids=np.array([ids], np.int32),
    )


class Out:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None

    def emit(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens.append(ev.token_id)
        else:
            self.finish = ev


def request(prompt: list[int], max_tokens: int = 4, **kw) -> tuple[GenerationRequest, Out]:
    out = Out()
    dec = Decoder(SamplingParams(max_tokens=max_tokens, temperature=0.0), frozenset({EOS}), str)
    return GenerationRequest(prompt=prompt, decoder=dec, emit=out.emit, **kw), out


def scheduler(
    rows: int,
    step_tokens: int,
    scorer: Scorer | None = None,
    prefill_tokens: int | None = None,
    **kw,
) -> BatchScheduler:
    """A scheduler on the fake engine; `prefill_tokens` (a step without decode rows) defaults
    to `step_tokens`, so the budget tests see one budget."""
    sched = BatchScheduler(
        lambda: FakeEngine(rows, **kw),
        max_concurrent=rows,
        max_queued=64,
        step_tokens=step_tokens,
        prefill_tokens=step_tokens if prefill_tokens is None else prefill_tokens,
    )
    sched.scorer = scorer
    sched.load()
    return sched


def drain(sched: BatchScheduler, limit: int = 1000) -> list[StepPlan]:
    plans = []
    while not sched.idle() or (sched.scorer is not None and sched.scorer.pending()):
        plans.append(sched.step())
        assert len(plans) < limit
    return plans


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    sched = scheduler(1, 0)
    req, out = request(prompt, max_tokens)
    sched.submit(req)
    drain(sched)
    return out.tokens
