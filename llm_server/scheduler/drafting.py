"""Drafts for speculative decoding: prompt lookup (`--speculative ngram`) and predicted outputs.

A row drafts the tokens that followed the latest earlier occurrence of its last n tokens
(n from `NGRAM_MAX` down to `NGRAM_MIN`) in its own prompt + output: text that quotes its
input (edits, rewrites, answers over passages) repeats long runs of it. A request with an
OpenAI `prediction` drafts from the predicted text's tokens first, aligned to its output.
The scheduler verifies every row's draft in the step's one forward and commits it position by
position exactly as plain decoding would (executor.py), so greedy output is unchanged and a
sampled row's tokens keep their distribution (see `executor.PlanExecutor._accept`).

Each row keeps an `NgramIndex` updated with each new token (no scan of its history per step)
and an estimate of how often its draft ids are accepted; `spec_policy.StepCosts` decides from
that and the measured step times how long each row's draft is (often: none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from llm_server.scheduler.draft_state import DraftState, NgramIndex, Prediction, PredictionUsage
from llm_server.scheduler.request import GenerationRequest
from llm_server.scheduler.spec_policy import StepCosts


def draft_state(req: GenerationRequest) -> DraftState:
    """The request's drafting record, made on first use."""
    if req.draft is None:
        pred = Prediction(req.prediction) if req.prediction is not None else None
        req.draft = DraftState(NgramIndex(req.prompt), pred)
    return req.draft


def prediction_usage(req: GenerationRequest) -> PredictionUsage | None:
    """The prediction counts of a finished request (None: it had no prediction)."""
    if req.prediction is None:
        return None
    state = draft_state(req)
    state.sync(req.decoder.tokens)
    return PredictionUsage(state.prediction.matched, state.predicted_rejected)


def eligible(req: GenerationRequest) -> bool:
    """Whether a request's row may verify drafts: any sampling (greedy or not; a grammar masks
    each position in turn), but not with logprobs (a verified position's logits match plain
    decoding's only to float32 rounding, and logprobs are reported as numbers)."""
    return not req.decoder.params.logprobs


def drafts(
    running: Mapping[int, GenerationRequest],
    spec_tokens: int,
    costs: StepCosts,
    lookup: bool = True,
    hook: Callable[[GenerationRequest], tuple[int, ...]] | None = None,
) -> dict[int, tuple[int, ...]]:
    """Each decoding row's draft for the next step: row -> ids, rows without one left out.

    Candidates come from the row's prediction, then prompt lookup (`lookup`: --speculative
    ngram), up to `spec_tokens` ids and what max_tokens leaves; `costs.lengths` then cuts each
    to what pays (spec_policy.py). `hook(req)` replaces all of that in tests.
    """
    out: dict[int, tuple[int, ...]] = {}
    rates: dict[int, float] = {}
    decoding = 0
    costs.tick()
    for row, req in running.items():
        if req.prefilled < len(req.prompt) or req.last_token is None:
            continue
        decoding += 1
        if req.cancelled.is_set() or not eligible(req):
            continue
        # the step gives at most 1 + len(draft) tokens: no more than max_tokens allows
        left = req.decoder.params.max_tokens - len(req.decoder.tokens)
        room = min(spec_tokens, left - 1)
        state = draft_state(req)
        if room <= 0:
            continue
        if hook is not None:
            draft = tuple(int(t) for t in hook(req))[:room]
            state.source = "hook"
        else:
            draft = state.propose(req.decoder.tokens, room, lookup)
            state.acceptance.tick()
        if draft:
            out[row] = draft
            rates[row] = state.acceptance.rate(costs.source_rate(state.source))
    if hook is not None or not out:
        return out
    lengths = costs.lengths(decoding, {row: (rates[row], len(d)) for row, d in out.items()})
    return {row: out[row][:n] for row, n in lengths.items() if n > 0}
