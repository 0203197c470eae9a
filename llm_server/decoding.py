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
NUCLEUS_RATIOS = (1e-3, 1e-7)  # top_p first sorts the tokens this likely relative to the top
TOP_K_WINDOWS = (8.0, 16.0, 32.0)  # top_k first looks this far below the largest (scaled) logit
DRAW_BLOCK = 1024  # tokens per block of the two-level inverse CDF


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop sequence
    LENGTH = "length"  # max_tokens or the context is full
    CANCELLED = "cancelled"  # client went away
    ERROR = "error"  # engine failure isolated to this request


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of decoding (validated by the API layer).

    Defaults leave the logits untouched: top_k 0 and min_p 0 are off, penalties at their
    neutral values, no logit bias.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS alternatives per token
    ignore_eos: bool = False
    top_k: int = 0  # keep the k most likely tokens; 0: off
    min_p: float = 0.0  # drop tokens below min_p * p(most likely); 0: off
    repetition_penalty: float = 1.0  # over prompt + generated tokens (HF/vLLM); 1: off
    presence_penalty: float = 0.0  # over generated tokens (OpenAI); 0: off
    frequency_penalty: float = 0.0  # over generated tokens (OpenAI); 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    @property
    def reshapes_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits before the choice."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )

    @property
    def plain_greedy(self) -> bool:
        """Whether the next token is exactly the argmax of the raw logits."""
        return self.temperature <= 0.0 and not self.reshapes_logits


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
    """One request's token choice: bias and penalties, then temperature and the top-k, top-p
    and min-p masks (the order of vLLM and HF), with a per-request RNG (seeded when asked).

    Each step costs O(vocab) only for the operations a request turned on; penalties index
    just the tokens seen so far. The sampler remembers every token it returns.
    """

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()) -> None:
        self.params = params
        self.temperature = params.temperature
        self.top_p = params.top_p
        self.rng = np.random.default_rng(params.seed)
        self._reshapes = params.reshapes_logits  # fixed per request; adjust() runs every step
        bias = dict(params.logit_bias)
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
        # repetition penalty: every distinct id of prompt + output
        self._seen = set(int(t) for t in prompt) if params.repetition_penalty != 1.0 else set()
        self._seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        # frequency / presence penalties: distinct output ids and how often each came
        self._out_pos: dict[int, int] = {}
        self._out_ids = np.zeros(0, dtype=np.int64)
        self._out_counts = np.zeros(0, dtype=np.float64)

    def __call__(self, logits: np.ndarray) -> int:
        """logits [vocab] float32 (masked entries are -inf) -> token id."""
        z = self.adjust(logits)
        token = int(np.argmax(z)) if self.temperature <= 0.0 else self._sample(z)
        self._record(token)
        return token

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """logits [vocab] -> the logits after logit_bias, then the repetition penalty, then the
        frequency and presence penalties (a float64 copy; `logits` itself when none is on)."""
        if not self._reshapes:
            return logits
        p = self.params
        z = logits.astype(np.float64)
        if self._bias_ids.size:
            z[self._bias_ids] += self._bias
        if p.repetition_penalty != 1.0 and self._seen_ids.size:
            s = z[self._seen_ids]
            z[self._seen_ids] = np.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self._out_ids.size:
            z[self._out_ids] -= self._out_counts * p.frequency_penalty + p.presence_penalty
        return z

    def probabilities(self, z: np.ndarray) -> np.ndarray:
        """Adjusted logits [vocab] -> the distribution drawn from, float64 [vocab]."""
        ids, probs = self._distribution(z)
        if ids is None:
            return probs
        out = np.zeros(np.shape(z)[-1])
        out[ids] = probs
        return out

    def _distribution(self, z: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """softmax(z / temperature) masked by top_k, then top_p, then min_p, renormalised.

        Returns (ids, probs): the tokens that may still be drawn and their probabilities
        (ids None: all of them, probs is [vocab]); later masks only see what earlier ones kept.
        """
        z = np.asarray(z, dtype=np.float64) / self.temperature  # a new array
        ids = None
        k = self.params.top_k
        if 0 < k < z.shape[0]:
            ids = _top_k(z, k)
            z = z[ids]
        z -= z.max()
        probs = np.exp(z)
        probs /= probs.sum()
        if self.top_p < 1.0:
            keep = _nucleus(probs, self.top_p)
            ids = keep if ids is None else ids[keep]
            probs = probs[keep]
            probs /= probs.sum()
        if self.params.min_p > 0.0:
            keep = np.flatnonzero(probs >= self.params.min_p * probs.max())
            if keep.size < probs.size:
                ids = keep if ids is None else ids[keep]
                probs = probs[keep]
                probs /= probs.sum()
        return ids, probs

    def _sample(self, z: np.ndarray) -> int:
        ids, probs = self._distribution(z)
        j = _draw(probs, self.rng.random())
        return j if ids is None else int(ids[j])

    def _record(self, token: int) -> None:
        p = self.params
        if p.repetition_penalty != 1.0 and token not in self._seen:
            self._seen.add(token)
            self._seen_ids = np.append(self._seen_ids, token)
        if p.frequency_penalty or p.presence_penalty:
            pos = self._out_pos.get(token)
            if pos is None:
                self._out_pos[token] = self._out_ids.size
                self._out_ids = np.append(self._out_ids, token)
                self._out_counts = np.append(self._out_counts, 1.0)
            else:
                self._out_counts[pos] += 1.0


def _top_k(z: np.ndarray, k: int) -> np.ndarray:
    """Ids of the `k` largest of z [vocab] plus any tied with the k-th (HF keeps ties).

    Partitions only the values near the maximum when at least k lie there: selecting from
    the whole vocabulary costs ~0.5 ms, from the few hundred near the top almost nothing.
    """
    top = z.max()
    cand = None
    for width in TOP_K_WINDOWS:
        near = np.flatnonzero(z >= top - width)
        if near.size >= k:  # then the k largest are all in `near`
            cand = near
            break
    sub = z if cand is None else z[cand]
    kth = np.partition(sub, sub.size - k)[sub.size - k]
    keep = np.flatnonzero(sub >= kth)
    return keep if cand is None else cand[keep]


def _draw(probs: np.ndarray, u: float) -> int:
    """Inverse CDF: the index i where the running sum of probs first exceeds u * sum.

    The draw rng.choice(p=probs) makes, without its O(vocab) checks of p, and summed in blocks
    of DRAW_BLOCK (one cumsum over the whole vocabulary is the slowest step of sampling).
    """
    n = probs.shape[0]
    full = n - n % DRAW_BLOCK
    sums = probs[:full].reshape(-1, DRAW_BLOCK).sum(axis=1)
    if full < n:
        sums = np.append(sums, probs[full:].sum())
    csum = np.cumsum(sums)
    target = u * csum[-1]
    b = min(int(np.searchsorted(csum, target, side="right")), sums.size - 1)
    start = b * DRAW_BLOCK
    seg = probs[start : start + DRAW_BLOCK]
    cdf = np.cumsum(seg) + (csum[b - 1] if b else 0.0)
    j = int(np.searchsorted(cdf, target, side="right"))
    if j >= seg.size:  # rounding between the two sums: the block's last possible token
        j = int(np.flatnonzero(seg)[-1])
    return start + j


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the most likely tokens whose mass first reaches `top_p`, best first.

    Sorts only the tokens within NUCLEUS_RATIOS of the most likely one when they already hold
    `top_p` (every other token is less likely than each of them, so the answer is the same):
    a peaked distribution never pays for sorting the whole vocabulary.
    """
    top = probs.max()
    cand = None
    for ratio in NUCLEUS_RATIOS:
        near = np.flatnonzero(probs >= top * ratio)
        if probs[near].sum() >= top_p:
            cand = near
            break
    if cand is None:
        order = np.argsort(-probs, kind="stable")
    else:
        order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    return order[: int(np.searchsorted(cum, top_p)) + 1]


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
    floor: int = 0  # a match starts here or later (the text before was pushed unarmed)

    def push(self, delta: str, armed: bool = True) -> str:
        """Add `delta`; return the text now safe to emit. Unarmed (a grammar that does not
        accept yet), no stop sequence matches in the text so far."""
        self.text += delta
        if not self.stops or not armed:
            out, self.emitted = self.text[self.emitted :], len(self.text)
            self.floor = len(self.text) if self.stops else 0
            return out
        start = max(self.floor, self.emitted - max(len(s) for s in self.stops))
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

    def accepting(self) -> bool:
        """True when the text so far is a whole answer, so an EOS may end it here."""
        return True


class Decoder:
    """Turns one request's logits into tokens, text deltas and a finish reason."""

    def __init__(
        self,
        params: SamplingParams,
        eos_ids: frozenset[int],
        decode: Callable[[Sequence[int]], str],
        constraint: LogitsConstraint | None = None,
        prompt: Sequence[int] = (),
    ) -> None:
        """`prompt`: the request's prompt ids (the repetition penalty counts them too)."""
        self.params = params
        self.eos_ids = frozenset() if params.ignore_eos else eos_ids
        self.sampler = Sampler(params, prompt)
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
        # an EOS id ends the answer only where its grammar accepts: a checkpoint may list ids
        # a grammar takes as text (generation_config.json), and those then stay text
        ends = token in self.eos_ids and (self.constraint is None or self.constraint.accepting())
        done_by_constraint = self.constraint is not None and self.constraint.advance(token)
        if ends:  # EOS ends the answer; it is not part of it
            return StepOutput(token, self._flush(), None, FinishReason.STOP)
        # likewise a stop sequence: none cuts a call (or a schema) its grammar has not accepted
        armed = not self.params.stop or self.constraint is None or self.constraint.accepting()
        text = self.stops.push(self.detok.add(token), armed)
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
