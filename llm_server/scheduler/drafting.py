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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llm_server.scheduler.spec_policy import Acceptance, StepCosts

if TYPE_CHECKING:
    from llm_server.scheduler.request import GenerationRequest

NGRAM_MAX = 3
NGRAM_MIN = 1
PREDICTION = "prediction"  # the drafting source of OpenAI predicted outputs


class NgramIndex:
    """Where each n-gram (n = NGRAM_MIN..NGRAM_MAX) of a growing token list last occurred with
    a token after it; `extend` costs O(new tokens), `propose` O(k)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        # n-gram -> position of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            j = len(self.tokens)  # t follows every n-gram that ends at j - 1
            for n in range(NGRAM_MIN, min(NGRAM_MAX, j) + 1):
                self._next[tuple(self.tokens[j - n : j])] = j
            self.tokens.append(int(t))

    def propose(self, k: int) -> tuple[tuple[int, ...], int]:
        """(up to k ids that followed the latest earlier match of the longest tail n-gram, n);
        ((), 0) when no tail n-gram occurred before."""
        toks = self.tokens
        if k <= 0:
            return (), 0
        for n in range(min(NGRAM_MAX, len(toks) - 1), NGRAM_MIN - 1, -1):
            at = self._next.get(tuple(toks[len(toks) - n :]))
            if at is not None:
                return tuple(toks[at : at + k]), n
        return (), 0


def propose(tokens: Sequence[int], k: int) -> tuple[int, ...]:
    """Up to `k` ids that followed the latest earlier match of the last n ids of `tokens`."""
    return NgramIndex(tokens).propose(k)[0]


class Prediction:
    """A request's predicted output (token ids) aligned to what it has generated so far.

    `at` is the prediction position the next output token is expected to equal; a token that
    differs loses the alignment, which the longest tail n-gram of the output found in the
    prediction (the first occurrence after the last aligned position, else the first) restores.
    """

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = tuple(int(t) for t in ids)
        self.at: int | None = 0
        self.last = 0  # the last aligned position (a re-alignment prefers to move forward)
        self.matched = 0  # output tokens equal to the aligned prediction token
        self._where: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after it
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            for j in range(n, len(self.ids) + 1):
                self._where.setdefault(self.ids[j - n : j], []).append(j)

    def note(self, token: int) -> None:
        """One more output token."""
        if self.at is not None and self.at < len(self.ids) and self.ids[self.at] == token:
            self.at += 1
            self.last = self.at
            self.matched += 1
        else:
            self.at = None

    def propose(self, output: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to `k` predicted ids to follow `output` (the generated ids so far)."""
        if self.at is None:
            for n in range(min(NGRAM_MAX, len(output)), NGRAM_MIN - 1, -1):
                spots = self._where.get(tuple(output[len(output) - n :]))
                if spots:
                    self.at = next((j for j in spots if j >= self.last), spots[0])
                    break
        if self.at is None or k <= 0:
            return ()
        return self.ids[self.at : self.at + k]


@dataclass
class DraftState:
    """One request's drafting record: its lookup index, prediction, acceptance and counts."""

    index: NgramIndex
    prediction: Prediction | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    seen: int = 0  # output tokens already in the index
    source: str = ""  # where the draft under verification came from
    drafted: int = 0  # draft ids verified
    accepted: int = 0  # draft ids kept
    predicted_rejected: int = 0  # prediction draft ids not kept

    @classmethod
    def of(cls, req: GenerationRequest) -> DraftState:
        """The request's record, made on first use."""
        if req.draft is None:
            pred = Prediction(req.prediction) if req.prediction is not None else None
            req.draft = cls(NgramIndex(req.prompt), pred)
        return req.draft

    def sync(self, output: Sequence[int]) -> None:
        """Take in the output tokens generated since the last call."""
        new = output[self.seen :]
        if not new:
            return
        self.index.extend(new)
        if self.prediction is not None:
            for t in new:
                self.prediction.note(t)
        self.seen = len(output)

    def propose(self, output: Sequence[int], k: int, lookup: bool) -> tuple[int, ...]:
        """Up to `k` ids: from the prediction while it has some, else by prompt lookup (when
        `lookup`); notes the source for `note`."""
        self.sync(output)
        if self.prediction is not None:
            draft = self.prediction.propose(output, k)
            if draft:
                self.source = PREDICTION
                return draft
        if not lookup:
            return ()
        draft, n = self.index.propose(k)
        self.source = f"ngram{n}"
        return draft

    def note(self, drafted: int, accepted: int, costs: StepCosts) -> None:
        """A verified draft of `drafted` ids of which the first `accepted` were kept."""
        self.drafted += drafted
        self.accepted += accepted
        if self.source == PREDICTION:
            self.predicted_rejected += drafted - accepted
        self.acceptance.note(drafted, accepted, costs.source_rate(self.source))
        costs.note(self.source, drafted, accepted)


@dataclass(frozen=True)
class PredictionUsage:
    """OpenAI's `usage.completion_tokens_details` for a request with a `prediction`."""

    accepted: int  # output tokens that matched the prediction where it was aligned
    rejected: int  # prediction ids drafted and verified but not kept


def prediction_usage(req: GenerationRequest) -> PredictionUsage | None:
    """The prediction counts of a finished request (None: it had no prediction)."""
    if req.prediction is None:
        return None
    state = DraftState.of(req)
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
        state = DraftState.of(req)
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
