"""Per-request decoding: sampling, incremental detokenization, stop sequences and limits.

A `Decoder` consumes one row's logits per step and says what to emit; it never knows whether
its request runs alone or in a batch, so output is the same either way.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop sequence
    LENGTH = "length"  # max_tokens or the context is full
    CANCELLED = "cancelled"  # client went away
    ERROR = "error"  # engine failure isolated to this request


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of decoding (validated by the API layer)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS alternatives per token
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for a request."""

    token_id: int
    text: str  # new text safe to show (may be empty while held back)
    logprob: TokenLogprob | None
    finish: FinishReason | None


class Sampler:
    """Greedy or temperature/top-p sampling with a per-request RNG (seeded when asked)."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = params.temperature
        self.top_p = params.top_p
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """logits [vocab] float32 (masked entries are -inf) -> token id."""
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            keep = order[: int(np.searchsorted(cum, self.top_p) + 1)]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self.rng.choice(probs.shape[0], p=probs))


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """log-softmax of the raw logits at `token`, plus the `top` best alternatives."""
    z = logits.astype(np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    alts: tuple[tuple[int, float], ...] = ()
    if top > 0:
        idx = np.argpartition(-z, top - 1)[:top]
        idx = idx[np.argsort(-z[idx], kind="stable")]
        alts = tuple((int(i), float(z[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(z[token] - lse), alts)


class IncrementalDetokenizer:
    """Text deltas that never split a multi-byte character (the prefix/read offset method)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end (a dangling partial character)."""
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        new_text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]


@dataclass
class StopMatcher:
    """Holds back text that could begin a stop sequence; cuts the output at a match."""

    stops: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    matched: bool = field(default=False)

    def push(self, delta: str) -> str:
        """Add `delta`; return the text now safe to emit."""
        self.text += delta
        if not self.stops:
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out
        start = max(0, self.emitted - max(len(s) for s in self.stops))
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            cut = min(hits)
            self.matched = True
            out = self.text[self.emitted : cut]
            self.text, self.emitted = self.text[:cut], cut
            return out
        safe = len(self.text) - self._held_back()
        out = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out

    def _held_back(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


class LogitsConstraint:
    """Interface of a per-request token mask (grammar-constrained decoding)."""

    def mask(self, logits: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        """Return logits with disallowed tokens set to -inf."""
        raise NotImplementedError

    def advance(self, token: int) -> bool:  # pragma: no cover - interface
        """Accept `token`; True when the constraint is complete (must stop)."""
        raise NotImplementedError


class Decoder:
    """Turns one request's logits into tokens, text deltas and a finish reason."""

    def __init__(
        self,
        params: SamplingParams,
        eos_ids: frozenset[int],
        decode: Callable[[Sequence[int]], str],
        constraint: LogitsConstraint | None = None,
    ) -> None:
        self.params = params
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.sampler = Sampler(params)
        self.detok = IncrementalDetokenizer(decode)
        self.stops = StopMatcher(params.stop)
        self.constraint = constraint
        self.tokens: list[int] = []

    @property
    def text(self) -> str:
        return self.stops.text

    def step(self, logits: np.ndarray, room: int) -> StepOutput:
        """Sample from logits [vocab]; `room` is how many positions the row has left."""
        raw = logits
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = self.sampler(logits)
        self.tokens.append(token)
        lp = None
        if self.params.logprobs:
            lp = token_logprob(raw, token, self.params.top_logprobs)
        done_by_constraint = self.constraint is not None and self.constraint.advance(token)
        if token in self.eos_ids:  # EOS ends the answer; it is not part of it
            return StepOutput(token, self._flush(), None, FinishReason.STOP)
        text = self.stops.push(self.detok.add(token))
        if self.stops.matched:
            return StepOutput(token, text, lp, FinishReason.STOP)
        if done_by_constraint:
            return StepOutput(token, text + self._flush(), lp, FinishReason.STOP)
        if len(self.tokens) >= self.params.max_tokens or room <= 0:
            return StepOutput(token, text + self._flush(), lp, FinishReason.LENGTH)
        return StepOutput(token, text, lp, None)

    def _flush(self) -> str:
        text = self.stops.push(self.detok.flush())
        if self.stops.matched:
            return text
        return text + self.stops.flush()
