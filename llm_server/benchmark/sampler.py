"""Per-token cost of the Sampler on one logits row: every sampling parameter off vs on.

    python -m llm_server.benchmark.sampler [--vocab 49152] [--steps 300] [--repeats 3] [--model DIR]

By default on numpy only: rows of random logits the size of SmolLM2's vocabulary. With
`--model DIR` the rows are that model's own logits over a short greedy answer (real logits are
more peaked, which is what the near-the-top shortcuts of top_k and top_p rely on). A prompt of
512 ids feeds the repetition penalty; the steps are as many as a long answer.
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


def random_rows(vocab: int, count: int = 16) -> np.ndarray:
    """[count, vocab] float32 logits drawn at random."""
    return np.random.default_rng(0).normal(size=(count, vocab)).astype(np.float32) * 4


def model_rows(model: str, count: int = 16) -> np.ndarray:
    """[count, vocab] float32: the model's logits at each step of a greedy answer."""
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.tokenizer import Tokenizer

    tok = Tokenizer(model)
    engine = MLXEngine(model, EngineSettings(rows=1, prefix_cache_bytes=0))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about Paris."}])
    rows = [engine.prefill(0, prompt)]
    while len(rows) < count:
        rows.append(engine.decode([0], [int(np.argmax(rows[-1]))])[0])
    return np.stack(rows).astype(np.float32)


def per_token_us(rows: np.ndarray, steps: int, **kw) -> float:
    """Median microseconds per Sampler call over `steps` calls, cycling through `rows`."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, rows.shape[1], size=512).tolist()
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
    ap.add_argument("--model", help="a model folder whose own logits to sample from")
    ap.add_argument("--repeats", type=int, default=3, help="runs per case; the fastest is shown")
    args = ap.parse_args(argv)
    rows = model_rows(args.model) if args.model else random_rows(args.vocab)
    source = args.model or "random logits"
    print(
        f"{source}: vocab {rows.shape[1]}, {args.steps} steps, "
        f"median per token (best of {args.repeats})"
    )
    for name, kw in CASES.items():
        best = min(per_token_us(rows, args.steps, **kw) for _ in range(args.repeats))
        print(f"  {name:28s} {best:8.1f} us")


if __name__ == "__main__":
    main()
