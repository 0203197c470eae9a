"""The engine-only decode rate: what the served rate is compared with.

`python -m llm_server.benchmark.engine_rate MODEL ROWS [STEPS]` loads the MLX engine as the
server does (same defaults), fills ROWS rows with a short prompt each and times STEPS batched
decode steps of all rows; prints one JSON object. Run as a subprocess with the servers' env
(`measure`), so the BLAS preload and the thread settings are the servers'.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 64  # each row's prompt: a short chat turn


def _measure_here(model: Path, rows: int, steps: int) -> dict:
    import numpy as np

    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    engine = MLXEngine(model, EngineSettings(rows=rows))
    rng = np.random.default_rng(0)
    for row in range(rows):
        engine.prefill(row, rng.integers(3, 1000, PROMPT_TOKENS).tolist())
    tokens = list(range(5, 5 + rows))
    all_rows = list(range(rows))
    for _ in range(3):  # warm-up: first shapes, allocations
        tokens = engine.decode(all_rows, tokens).argmax(-1).tolist()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = engine.decode(all_rows, tokens).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times))
    return {"rows": rows, "steps": steps, "step_ms": step_s * 1000.0, "tokens_per_s": rows / step_s}


def measure(model: Path, rows: int, steps: int = 24, env: dict | None = None) -> dict:
    """The engine-only rate of `rows` rows (median step), measured in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-m", "llm_server.benchmark.engine_rate", str(model), str(rows), str(steps)],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"engine rate at {rows} rows failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    model_arg, rows_arg = Path(sys.argv[1]), int(sys.argv[2])
    steps_arg = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    print(json.dumps(_measure_here(model_arg, rows_arg, steps_arg)))
