"""`plan()`: what the next step does, decided from the queue, the rows and the budget alone.

Pure: it reads requests and returns a `StepPlan` (engines/plan.py); it changes nothing, calls
no engine and never waits, so the admission, budget and fairness rules are unit-tested without
MLX (tests/scheduler/test_plan.py). The rules, in order:

  1. cancelled running rows retire and cancelled queued requests are dropped (S5);
  2. every running row whose prompt is complete decodes one token (S2); each costs one position
     of the step budget, plus one per id of the draft the scheduler gave it (`drafts`,
     speculative decoding: scheduler/drafting.py), verified in the same forward;
  3. rows still in their prompt get the next chunk first, oldest request first, so a long prompt
     advances every step and is never overtaken by a newcomer. With no row decoding nobody is
     stalled by a long step, so the chunks share `prefill_budget` (larger: a lone long prompt
     runs at the machine's prefill rate, issue 38) instead of `budget`;
  4. then queued requests take free rows in FIFO order (S3) while budget is left (a request
     `waiting` for room in the memory budget is passed over until room may have appeared,
     scheduler/batch.py `_park`), each the
     row `row_for` picks among those left (the engine's `preferred_row`: the row still
     holding the longest prefix of its prompt; else the lowest); a request
     that cannot get a chunk this step stays at the head of the queue (no skipping). A request
     whose prompt shares at least `share_min` tokens with a prompt that is not computed that
     far yet waits a step too, so it copies the prefix from that row instead of computing it
     again (the engine copies only what a row holds when the step starts);
  5. the open scoring prompts (on the engine's scoring rows, scheduler/scorer.py) get what is
     left, in the order they were opened, at most SCORE_CHUNK positions each (C1, C3): they
     ride in the same forward as rows more (each its own query length), so a long scoring
     batch never pauses the decode rows. With no row decoding or in its prompt nobody is
     stalled, and every open prompt advances SCORE_CHUNK positions;
  6. a pump (embeddings, the session scorer fallback) runs after the forward when it has work
     and no lease waits (C1, S6).

`budget` is `--step-tokens`: positions per forward, decode rows included (0: unlimited, every
prompt runs whole in the step that admits it); `prefill_budget` bounds a step without decode
rows (the scheduler's `prefill_tokens`, bounded by the activation memory of one forward). Prefill always gets at least one position, so
a prompt finishes whatever the number of decoding rows; scoring gets at least one when no
prompt chunk took the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from llm_server.engines.contract import SCORE_CHUNK
from llm_server.engines.plan import (
    Admission,
    DecodeRow,
    PrefillChunk,
    ScoreChunk,
    StepPlan,
    prompt_key,
)
from llm_server.scheduler.request import GenerationRequest, Priority

if TYPE_CHECKING:
    from llm_server.scheduler.scorer import OpenPrompt


def plan(
    queue: Iterable[GenerationRequest],
    running: Mapping[int, GenerationRequest],
    free: Iterable[int],
    budget: int,
    *,
    admit: bool = True,
    pump: bool = False,
    share_min: int = 0,
    drafts: Mapping[int, tuple[int, ...]] | None = None,
    scoring: Sequence[OpenPrompt] = (),
    prefill_budget: int | None = None,
    row_for: Callable[[list[int], list[int]], int | None] | None = None,
    admit_batch: bool = True,
    waiting: Callable[[GenerationRequest], bool] | None = None,
) -> StepPlan:
    """The next step. `running`: row -> request; `free`: rows nobody holds; `admit`: False
    while a pipelined step for the current rows is in flight (newcomers join after it);
    `pump`: a pump has work and no lease waits; `share_min`: the shortest prompt prefix
    the engine copies from another row (0: it never does); `drafts`: row -> draft ids to
    verify after its pending token; `scoring`: the scoring prompts open on scoring rows,
    in the order they were opened; `prefill_budget`: positions per forward when no row
    decodes (None: `budget`; 0: unlimited); `row_for(prompt, rows)`: the free row of `rows`
    a prompt opens on (reads only; None, or its answer None: the lowest); `admit_batch`: False
    holds back the batch lines, which queue behind every interactive request (S11);
    `waiting(request)`: True while a queued request waits for room in the memory budget (it
    keeps its place; those behind it may be admitted)."""
    live = {row: req for row, req in running.items() if not req.cancelled.is_set()}
    retire = tuple(sorted(row for row in running if row not in live))
    queued = list(queue)
    drop = tuple(req.seq for req in queued if req.cancelled.is_set())

    drafts = drafts or {}
    decode = tuple(
        DecodeRow(row, req.last_token, tuple(drafts.get(row, ())))
        for row, req in sorted(live.items())
        if req.prefilled >= len(req.prompt) and req.last_token is not None
    )
    used = sum(1 + len(d.draft) for d in decode)
    left = _left(budget, used, prefill_budget)

    chunks: list[PrefillChunk] = []
    for req in sorted(
        (r for r in live.values() if r.prefilled < len(r.prompt)), key=lambda r: r.seq
    ):
        if left == 0:
            break
        chunk = _chunk(req, req.row, req.prefilled, left)
        chunks.append(chunk)
        left = None if left is None else left - chunk.tokens

    admissions: list[Admission] = []
    if admit:
        rows = sorted([*free, *retire])
        for req in queued:
            if not rows or left == 0:
                break
            if req.cancelled.is_set() or (waiting is not None and waiting(req)):
                continue
            if req.priority is Priority.BATCH and not admit_batch:
                break
            if share_min and _wait_for_prefix(req, live.values(), chunks, share_min):
                break
            picked = None if row_for is None else row_for(_key(req.prompt, req.embeddings), rows)
            row = rows[0] if picked is None else picked
            rows.remove(row)
            admissions.append(Admission(req.seq, row, req.exclusive))
            if req.exclusive:
                continue  # runs alone before the forward, outside the budget
            chunk = _chunk(req, row, 0, left)
            chunks.append(chunk)
            left = None if left is None else left - chunk.tokens

    # nobody to stall (no row decoding or in its prompt): every open prompt advances a chunk
    idle = not decode and not chunks
    score = _score_chunks(scoring, None if idle else left) if admit else ()

    return StepPlan(
        retire=retire,
        drop=drop,
        admit=tuple(admissions),
        decode=decode,
        prefill=tuple(chunks),
        score=score,
        pump=pump,
        budget=max(budget, 0),
    )


def _left(budget: int, used: int, prefill_budget: int | None) -> int | None:
    """Positions left for prompt chunks after `used` decode positions (None: no bound). With
    no row decoding nobody waits on the step, so prompts run at the prefill budget (rule 3)."""
    if not used and prefill_budget is not None:
        budget = 0 if min(budget, prefill_budget) <= 0 else max(budget, prefill_budget)
    return None if budget <= 0 else max(budget - used, 1)


def _score_chunks(scoring: Sequence[OpenPrompt], left: int | None) -> tuple[ScoreChunk, ...]:
    """The open scoring prompts' next chunks, in the order they were opened: at most
    SCORE_CHUNK positions each (C3) and `left` positions in all (None: no bound)."""
    out: list[ScoreChunk] = []
    for p in scoring:
        if left == 0:
            break
        n = min(SCORE_CHUNK, len(p.prompt) - p.done, SCORE_CHUNK if left is None else left)
        out.append(ScoreChunk(p.key, p.row, p.prompt, p.done, p.done + n, p.top_k))
        left = None if left is None else left - n
    return tuple(out)


def _chunk(req: GenerationRequest, row: int, start: int, left: int | None) -> PrefillChunk:
    end = len(req.prompt) if left is None else min(len(req.prompt), start + left)
    return PrefillChunk(req.seq, row, req.prompt, start, end, req.embeddings)


def _wait_for_prefix(
    req: GenerationRequest,
    running: Iterable[GenerationRequest],
    chunks: list[PrefillChunk],
    share_min: int,
) -> bool:
    """Whether a prompt prefilled in this step would give `req` a longer prefix next step than
    the rows hold now."""
    key = _key(req.prompt, req.embeddings)
    ready = max(
        (min(_common(key, _key(r.prompt, r.embeddings)), r.prefilled) for r in running),
        default=0,
    )
    wanted = max((_common(key, _key(c.prompt, c.spans)) for c in chunks), default=0)
    return wanted >= share_min and wanted > ready


def _key(prompt: list[int], spans) -> list[int]:
    """What rows and the prefix cache match a prompt on: its ids, a span's content key at
    its positions (engines/plan.py: `prompt_key`)."""
    return prompt_key(prompt, spans) if spans else prompt


def _common(prompt: list[int], other) -> int:
    """Length of the common prefix of prompt[:-1] (what a row may copy) and `other`."""
    n = 0
    for a, b in zip(prompt[:-1], other, strict=False):
        if a != b:
            break
        n += 1
    return n
