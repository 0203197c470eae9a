"""What drafts gain or cost on a hybrid model (recurrent layers + attention), by acceptance.

    python -m llm_server.native.blas .venv/bin/python -m llm_server.benchmark.hybrid_drafts \
        [--model PATH] [--family qwen3_5] [--tokens 64] [--spec-tokens 4] [--repeats 3]

A rejected draft on a hybrid costs more than on a plain transformer: the rewind restores the
row's state from before the step and runs the kept positions again (executor.py:
`StepExecutor.rewind`). One row, greedy: the reference decodes `--tokens` tokens plainly, then
the same answer is decoded with drafts of `--spec-tokens` ids taken from the reference, all
right, right but the last, half right and all wrong. Prints ms per token, the speedup over
plain decoding and whether the output was identical. Without `--model` a random `--family`
checkpoint of about 0.1B parameters is built (llm_server/testing/families.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROMPT_TOKENS = 64
# a random model of roughly Qwen3.5-0.8B's layer shapes, fewer layers (seconds on 2 cores)
SIZES = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}
# ids of each draft that are right: all, all but the last, half, none
SPLITS = {"all right": 1.0, "last wrong": None, "half right": 0.5, "all wrong": 0.0}


def decode(engine, prompt: list[int], n: int, k: int, ref: list[int] | None, split) -> list[int]:
    """Greedy ids of one row; with `ref`, each step drafts its next `k` ids (`split` of them
    right), verifies them in the step and rewinds past the rejected ones."""
    import numpy as np

    from llm_server.engines.plan import DecodeRow, StepPlan

    out = [int(np.argmax(engine.prefill(0, prompt)))]
    while len(out) < n:
        nxt = ref[len(out) : len(out) + k] if ref is not None else []
        if not nxt:
            out.append(int(np.argmax(engine.decode([0], [out[-1]])[0])))
            continue
        right = len(nxt) - 1 if split is None else int(len(nxt) * split)
        draft = nxt[:right] + [(t + 1) % engine.vocab_size for t in nxt[right:]]
        base = engine.cursor(0)
        result = engine.run(StepPlan(decode=(DecodeRow(0, out[-1], tuple(draft)),)))
        kept = 0
        for i, logits in enumerate([result.logits[0], *result.verified[0]]):
            out.append(int(np.argmax(logits)))
            if i == len(draft) or out[-1] != draft[i]:
                break
            kept += 1
        engine.rewind(0, base + 1 + kept)
    engine.release(0)
    return out[:n]


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.testing.families import build_family_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="default: a random --family checkpoint")
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--spec-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="runs of each case (median time)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_family_checkpoint(Path(tmp), args.family, sizes=SIZES)
        engine = MLXEngine(model, EngineSettings(rows=1, prefix_cache_bytes=0))
        prompt = [int(t) for t in np.random.default_rng(0).integers(3, 380, PROMPT_TOKENS)]
        ref = decode(engine, prompt, args.tokens, 0, None, None)
        cases = {"off": (None, None), **{name: (ref, s) for name, s in SPLITS.items()}}
        times: dict[str, list[float]] = {name: [] for name in cases}
        same = {}
        for _ in range(args.repeats):  # the cases alternate, so load changes hit them alike
            for name, (drafts, split) in cases.items():
                t0 = time.perf_counter()
                got = decode(engine, prompt, args.tokens, args.spec_tokens, drafts, split)
                times[name].append(time.perf_counter() - t0)
                same[name] = got == ref
    off = statistics.median(times["off"])
    print(f"{engine.model_type}, {args.tokens} tokens, K={args.spec_tokens}")
    print("| drafts | ms/token | speedup | same output |")
    print("|---|---|---|---|")
    for name in cases:
        t = statistics.median(times[name])
        ms = 1000 * t / args.tokens
        print(f"| {name} | {ms:.1f} | {off / t:.2f}x | {same[name]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
