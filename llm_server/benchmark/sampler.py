"""Per-token cost of the Sampler on one logits row: every sampling parameter off vs on.

    python -m llm_server.benchmark.sampler [--vocab 49152] [--steps 300] [--repeats 3]

Runs on numpy only (no model): a row of random logits the size of SmolLM2's vocabulary, a
prompt of 512 ids for the repetition penalty, and as many steps as a long answer.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from llm_server.decoding import Sampler, SamplingParams

CASES: dict[str, dict] = {
    "greedy, all off": {"temperature": 0.0},
    "greedy + penalties + bias": {
        "temperature": 0.0,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "logit_bias": tuple((i, -1.0) for i in range(300)),
    },
    "temperature, all off": {"temperature": 0.8},
    "temperature + top_k 40": {"temperature": 0.8, "top_k": 40},
    "temperature + min_p 0.05": {"temperature": 0.8, "min_p": 0.05},
    "temperature + top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "everything on": {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "logit_bias": tuple((i, -1.0) for i in range(300)),
    },
}


def per_token_us(vocab: int, steps: int, **kw) -> float:
    """Median microseconds per Sampler call over `steps` calls on fresh logits rows."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(16, vocab)).astype(np.float32) * 4
    prompt = rng.integers(0, vocab, size=512).tolist()
    sampler = Sampler(SamplingParams(max_tokens=steps, seed=0, **kw), prompt)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        sampler(rows[i % len(rows)])
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest is shown")
    args = ap.parse_args(argv)
    print(f"vocab {args.vocab}, {args.steps} steps, median per token (best of {args.repeats})")
    for name, kw in CASES.items():
        best = min(per_token_us(args.vocab, args.steps, **kw) for _ in range(args.repeats))
        print(f"  {name:28s} {best:8.1f} us")


if __name__ == "__main__":
    main()
