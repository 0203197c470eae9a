"""Scoring throughput: prompts of 20-200 tokens through `/v1/completions` echo+logprobs.

One request carrying every prompt (the server scores them as padded batches) against one request
per prompt sent one after another. Prompts are token-id lists cut from the benchmark's chat texts,
so their lengths are exact and no BOS is added (C5).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import httpx

MIN_TOKENS = 20
MAX_TOKENS = 200
TIMEOUT_S = 900.0


class ScoringError(RuntimeError):
    """The server's scoring route failed or answered in an unexpected shape."""


@dataclass
class ScoringMode:
    wall_s: float  # best of the repeats
    tokens: int
    requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class ScoringResult:
    prompts: int
    lengths: list[int]
    padded: ScoringMode
    sequential: ScoringMode
    max_abs_logprob_diff: float  # padded vs one-by-one; C4 says 0 up to float rounding
    repeats: int
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.padded.tokens_per_s / self.sequential.tokens_per_s


def scoring_prompts(texts: list[str], encode, count: int, seed: int = 0) -> list[list[int]]:
    """`count` token-id prompts with lengths spread evenly over 20..200, in a fixed shuffled order."""
    stream: list[int] = []
    while len(stream) < MAX_TOKENS * 2:
        for text in texts:
            stream.extend(encode(text))
    if count == 1:
        lengths = [MAX_TOKENS]
    else:
        lengths = [
            round(MIN_TOKENS + (MAX_TOKENS - MIN_TOKENS) * i / (count - 1)) for i in range(count)
        ]
    random.Random(seed).shuffle(lengths)
    prompts = []
    for i, n in enumerate(lengths):
        start = (i * 37) % (len(stream) - n)  # different windows of the same text
        prompts.append(stream[start : start + n])
    return prompts


def _score(client: httpx.Client, url: str, prompts: list[list[int]]) -> list[list]:
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0.0}
    resp = client.post(f"{url}/v1/completions", json=body)
    if resp.status_code != 200:
        raise ScoringError(f"/v1/completions answered HTTP {resp.status_code}: {resp.text[:300]}")
    choices = sorted(resp.json().get("choices", []), key=lambda c: c.get("index", 0))
    if len(choices) != len(prompts):
        raise ScoringError(f"{len(prompts)} prompts scored but {len(choices)} choices came back")
    out = []
    for prompt, choice in zip(prompts, choices, strict=True):
        lps = ((choice.get("logprobs") or {}).get("token_logprobs")) or []
        if len(lps) != len(prompt) or lps[0] is not None:
            raise ScoringError(
                f"a {len(prompt)}-token prompt came back with {len(lps)} token_logprobs "
                "(expected one per prompt token, the first null)"
            )
        out.append(lps)
    return out


def _timed(fn) -> tuple[float, list]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def run_scoring(url: str, prompts: list[list[int]], repeats: int) -> ScoringResult:
    """Time both modes `repeats` times each (best kept); raises ScoringError on a bad answer."""
    tokens = sum(len(p) for p in prompts)
    with httpx.Client(trust_env=False, timeout=TIMEOUT_S) as client:
        _score(client, url, [prompts[0][:MIN_TOKENS]])  # warm-up: first-call set-up costs
        padded_best, seq_best = float("inf"), float("inf")
        padded_lps: list = []
        seq_lps: list = []
        for _ in range(repeats):
            wall, padded_lps = _timed(lambda: _score(client, url, prompts))
            padded_best = min(padded_best, wall)
            wall, seq_lps = _timed(lambda: [_score(client, url, [p])[0] for p in prompts])
            seq_best = min(seq_best, wall)
    diff = max(
        abs(a - b)
        for pa, pb in zip(padded_lps, seq_lps, strict=True)
        for a, b in zip(pa[1:], pb[1:], strict=True)
    )
    return ScoringResult(
        prompts=len(prompts),
        lengths=[len(p) for p in prompts],
        padded=ScoringMode(padded_best, tokens, 1),
        sequential=ScoringMode(seq_best, tokens, len(prompts)),
        max_abs_logprob_diff=diff,
        repeats=repeats,
    )
