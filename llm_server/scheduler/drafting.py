"""Prompt-lookup drafts for speculative decoding (`--speculative ngram`).

A row drafts the tokens that followed the latest earlier occurrence of its last n tokens
(n from `NGRAM_MAX` down to `NGRAM_MIN`) in its own prompt + output: text that quotes its
input (edits, rewrites, answers over passages) repeats long runs of it. The scheduler verifies
every row's draft in the step's one forward and keeps the longest prefix that greedy decoding
would have produced, plus one token (executor.py), so the output is unchanged.

Only plain greedy rows draft (no constraint, penalty, bias or logprobs); sampled rows decode
normally in the same step. A row whose drafts keep being rejected stops drafting for a while
(`DraftState`), so chat that does not repeat pays (almost) nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_server.scheduler.request import GenerationRequest

NGRAM_MAX = 3
NGRAM_MIN = 1
# adaptive back-off: after `MISSES` drafts in a row with nothing accepted, a row skips drafting
# for `PAUSE` steps (doubling each time it misses again, up to `PAUSE_MAX`)
MISSES = 2
PAUSE = 8
PAUSE_MAX = 128


def propose(tokens: Sequence[int], k: int) -> tuple[int, ...]:
    """Up to `k` ids that followed the latest earlier match of the last n ids of `tokens`."""
    if k <= 0:
        return ()
    n_tokens = len(tokens)
    for n in range(min(NGRAM_MAX, n_tokens - 1), NGRAM_MIN - 1, -1):
        tail = list(tokens[n_tokens - n :])
        # scan right to left: the latest occurrence (before the tail itself) predicts best
        for i in range(n_tokens - n - 1, -1, -1):
            if tokens[i] == tail[0] and list(tokens[i : i + n]) == tail:
                return tuple(tokens[i + n : i + n + k])
    return ()


@dataclass
class DraftState:
    """One request's drafting record: what was drafted and accepted, and its back-off."""

    drafted: int = 0  # draft ids verified
    accepted: int = 0  # draft ids that matched the greedy choice
    misses: int = 0  # drafts in a row with nothing accepted
    pause: int = 0  # steps left without drafting
    backoff: int = PAUSE

    def wants(self) -> bool:
        """Whether the row drafts at this step (counts a paused step down)."""
        if self.pause > 0:
            self.pause -= 1
            return False
        return True

    def note(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` ids of which `accepted` were kept."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted:
            self.misses, self.backoff = 0, PAUSE
            return
        self.misses += 1
        if self.misses >= MISSES:
            self.pause, self.misses = self.backoff, 0
            self.backoff = min(self.backoff * 2, PAUSE_MAX)


def eligible(req) -> bool:
    """Whether a request's tokens are exactly the argmax of the raw logits (it may draft)."""
    params = req.decoder.params
    return params.plain_greedy and req.decoder.constraint is None and not params.logprobs


def drafts(
    running: Mapping[int, GenerationRequest],
    spec_tokens: int,
    hook: Callable[[GenerationRequest], tuple[int, ...]] | None = None,
) -> dict[int, tuple[int, ...]]:
    """Each decoding eligible row's draft for the next step: row -> up to `spec_tokens` ids
    (prompt lookup with back-off, or `hook(req)` in tests); rows without one are left out."""
    out: dict[int, tuple[int, ...]] = {}
    for row, req in running.items():
        if req.prefilled < len(req.prompt) or req.last_token is None:
            continue
        if req.cancelled.is_set() or not eligible(req):
            continue
        # the step gives at most 1 + len(draft) tokens: no more than max_tokens allows
        left = req.decoder.params.max_tokens - len(req.decoder.tokens)
        room = min(spec_tokens, left - 1)
        if room <= 0:
            continue
        if req.draft is None:
            req.draft = DraftState()
        if hook is not None:
            draft = tuple(int(t) for t in hook(req))[:room]
        elif req.draft.wants():
            draft = propose([*req.prompt, *req.decoder.tokens], room)
        else:
            continue
        if draft:
            out[row] = draft
    return out
