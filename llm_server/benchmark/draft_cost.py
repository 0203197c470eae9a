"""What a verified draft costs on the engine: plain decode steps against drafted ones (issue 38).

    python -m llm_server.native.blas .venv/bin/python -m llm_server.benchmark.draft_cost \
        [--model PATH] [--rows 4] [--drafts 0,1,2,4,8] [--drafted-rows 1] [--steps 12]

Loads the MLX engine as the server does, fills `--rows` rows with a short chat-sized prompt
each, then alternates, round by round, a step of every row decoding one token with steps in
which `--drafted-rows` rows also verify a draft of k ids (k from `--drafts`; each drafted row
is rewound after the step, so every round starts from the same cursors). Prints the median
step time per k and what the spec policy's model (`a + r*rows + d*ids + c`) fits from
these steps, so the model's shape can be checked against the engine's real costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PROMPT_TOKENS = 64


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.plan import DecodeRow, StepPlan
    from llm_server.engines.settings import EngineSettings
    from llm_server.scheduler.spec_policy import StepCosts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="default: the embedded SmolLM2-135M")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--drafts", default="0,1,2,4,8", help="draft lengths k (0: plain step)")
    p.add_argument("--drafted-rows", type=int, default=1)
    p.add_argument("--steps", type=int, default=12, help="rounds (each runs every k once)")
    args = p.parse_args(argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    engine = MLXEngine(args.model, EngineSettings(rows=args.rows, prefix_cache_bytes=0))
    rng = np.random.default_rng(0)
    for row in range(args.rows):
        engine.prefill(row, rng.integers(100, 5000, PROMPT_TOKENS).tolist())
    ks = [int(k) for k in args.drafts.split(",")]
    times: dict[int, list[float]] = {k: [] for k in ks}
    costs = StepCosts()
    token = 42
    for i in range(args.steps + 2):  # 2 warm-up rounds
        for k in ks:
            drafted = min(args.drafted_rows, args.rows) if k else 0
            base = [engine.cursor(r) for r in range(args.rows)]
            plan = StepPlan(
                decode=tuple(
                    DecodeRow(r, token, tuple(range(7, 7 + k)) if r < drafted else ())
                    for r in range(args.rows)
                )
            )
            t0 = time.perf_counter()
            engine.run(plan)
            seconds = time.perf_counter() - t0
            for r in range(args.rows):
                engine.rewind(r, base[r])
            if i >= 2:
                times[k].append(seconds)
                costs.observe(args.rows, k * drafted, seconds)
    out = {
        "rows": args.rows,
        "drafted_rows": args.drafted_rows,
        "median_ms": {k: round(statistics.median(v) * 1000, 2) for k, v in times.items()},
        **costs.report(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
