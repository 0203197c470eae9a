"""A request's drafting record for speculative decoding: its n-gram index over prompt and
output, its OpenAI `prediction` aligned to the output, acceptance and counts (drafting.py
decides the drafts from them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llm_server.scheduler.spec_policy import Acceptance, StepCosts

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
