"""Engine-only decode step time: the compiled step against the eager one, in the same process,
or this checkout against another one (`--against DIR`, e.g. a checkout of main).

    python -m llm_server.native.blas python -m llm_server.benchmark.step [--model DIR] [--rows 1,4]
    python -m llm_server.native.blas python -m llm_server.benchmark.step --against ../main --rows 1

In-process: loads the model twice (compiled decode steps on and off), prefills the same prompts
into both and alternates their decode steps, so a shared machine's load hits both alike; prints
the median and best step time per row count, and how long building each step's graph takes.
`--against`: rounds of fresh processes, alternating between the two checkouts (only the
engine's public calls, so any version runs), each timing `--steps` decode steps.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from llm_server.benchmark.settings import probe_parser

# one checkout's decode steps: argv model rows steps; prints {"ms": [...]}
_STEPS_SCRIPT = """
import json, sys, time
try:  # the engine's module, wherever this checkout keeps it
    from llm_server.engines.mlx.engine import MLXEngine
except ImportError:
    from llm_server.engines.mlx_engine import MLXEngine
model, rows, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:  # one settings object where this checkout has it
    from llm_server.engines.settings import EngineSettings
    engine = MLXEngine(model, EngineSettings(rows=rows, compiled_decode=True))
except ImportError:
    try:  # the compiled step where this checkout has it
        engine = MLXEngine(model, rows=rows, compiled_decode=True)
    except TypeError:
        engine = MLXEngine(model, rows=rows)
span = min(1000, engine.vocab_size - 10)  # ids inside the vocabulary
for r in range(rows):
    engine.prefill(r, [(7 * i + 3 * r) % span + 10 for i in range(150 + 5 * r)])
tokens, ms = [5] * rows, []
for i in range(steps + 3):
    start = time.perf_counter()
    logits = engine.decode(list(range(rows)), tokens)
    ms.append((time.perf_counter() - start) * 1e3)
    tokens = logits.argmax(-1).tolist()
print(json.dumps({"ms": ms[3:]}))
"""


@dataclass(frozen=True)
class StepTimes:
    rows: int
    compiled_ms: list[float]  # whole decode() calls, one per step
    eager_ms: list[float]
    compiled_build_ms: list[float]  # building the step's graph (no evaluation)
    eager_build_ms: list[float]
    compiled_cpu_ms: list[float]  # process CPU time per step (less sensitive to other load)
    eager_cpu_ms: list[float]
    max_abs_diff: float  # largest |compiled - eager| logit over all steps (0.0 on the CPU)
    same_tokens: bool  # every step's greedy tokens equal


def _engines(model: str, rows: int):
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    compiled = MLXEngine(model, EngineSettings(rows=rows, compiled_decode=True))
    eager = MLXEngine(model, EngineSettings(rows=rows, compiled_decode=False))
    if compiled.fused is None:
        raise SystemExit(f"{model}: the fused decode step does not apply to this model")
    return compiled, eager


def _build_ms(engine, rows: list[int], tokens: list[int]) -> float:
    """Time to build one decode step's graph, without evaluating it. The graph is then
    evaluated: it rewrites the rows' next KV positions, which the next step writes again."""
    import mlx.core as mx

    ids = mx.array([[t] for t in tokens], dtype=mx.int32)
    starts = [engine.cursor(r) for r in rows]
    context = engine.forward.context(len(rows))
    start = time.perf_counter()
    logits = engine.forward.graph(rows, starts, ids, context)
    built = time.perf_counter() - start
    mx.eval(logits, *engine.row_table.held())
    return built * 1e3


def _prompt(vocab_size: int, row: int, length: int) -> list[int]:
    """A fixed prompt of ids inside the vocabulary (different per row)."""
    return [(7 * i + 3 * row) % min(1000, vocab_size - 10) + 10 for i in range(length)]


def measure(model: str, rows: int, steps: int, prompt_len: int) -> StepTimes:
    import numpy as np

    compiled, eager = _engines(model, rows)
    ids = list(range(rows))
    for engine in (compiled, eager):
        for r in ids:  # rows at different cursors
            engine.prefill(r, _prompt(engine.vocab_size, r, prompt_len + 5 * r))
    tokens = [5] * rows
    times: dict[str, list[float]] = {k: [] for k in ("c", "e", "cb", "eb", "cc", "ec")}
    diff, same = 0.0, True
    for i in range(steps + 3):
        t0, c0 = time.perf_counter(), time.process_time()
        a = compiled.decode(ids, tokens)
        t1, c1 = time.perf_counter(), time.process_time()
        b = eager.decode(ids, tokens)
        t2, c2 = time.perf_counter(), time.process_time()
        if i >= 3:  # the first steps trace and warm up
            times["c"].append((t1 - t0) * 1e3)
            times["e"].append((t2 - t1) * 1e3)
            times["cc"].append((c1 - c0) * 1e3)
            times["ec"].append((c2 - c1) * 1e3)
            times["cb"].append(_build_ms(compiled, ids, tokens))
            times["eb"].append(_build_ms(eager, ids, tokens))
        diff = max(diff, float(np.abs(a - b).max()))
        same = same and a.argmax(-1).tolist() == b.argmax(-1).tolist()
        tokens = a.argmax(-1).tolist()
    return StepTimes(
        rows, times["c"], times["e"], times["cb"], times["eb"], times["cc"], times["ec"], diff, same
    )


def _row(t: StepTimes) -> str:
    med, best = statistics.median, min
    c, e = med(t.compiled_ms), med(t.eager_ms)
    return (
        f"| {t.rows} | {e:.1f} | {c:.1f} | {e / c:.2f}x | {best(t.eager_ms):.1f} | "
        f"{best(t.compiled_ms):.1f} | {med(t.eager_build_ms):.2f} | {med(t.compiled_build_ms):.2f} "
        f"| {med(t.eager_cpu_ms):.1f} | {med(t.compiled_cpu_ms):.1f} "
        f"| {t.max_abs_diff:.1e} | {t.same_tokens} |"
    )


def _tree_steps(tree: Path, model: str, rows: int, steps: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    # the BLAS preload where that checkout keeps it (llm_server/blas.py before the folders)
    blas = (
        "llm_server.native.blas"
        if (tree / "llm_server/native/blas.py").exists()
        else "llm_server.blas"
    )
    cmd = [sys.executable, "-m", blas, sys.executable, "-c", _STEPS_SCRIPT,
           model, str(rows), str(steps)]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: the step script failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["ms"]


def against(model: str, other: Path, rows: int, steps: int, rounds: int) -> str:
    """Median and best step of this checkout and `other`, rounds alternating (order too)."""
    here = Path(__file__).resolve().parents[2]
    trees = {"other": other.resolve(), "this": here}
    times: dict[str, list[float]] = {"other": [], "this": []}
    for i in range(rounds):
        for name in ("other", "this") if i % 2 == 0 else ("this", "other"):
            times[name] += _tree_steps(trees[name], model, rows, steps)
    med = statistics.median
    return (
        f"| {rows} | {trees['other']} | {med(times['other']):.1f} | {min(times['other']):.1f} | "
        f"{med(times['this']):.1f} | {min(times['this']):.1f} | "
        f"{med(times['this']) / med(times['other']):.2f} | {len(times['this'])} |"
    )


def main(argv: list[str] | None = None) -> None:
    p = probe_parser("step", __doc__)
    p.add_argument("--rows", default="1", help="comma-separated row counts (default 1)")
    p.add_argument("--steps", type=int, default=40, help="measured steps per row count")
    p.add_argument("--prompt", type=int, default=150, help="prompt tokens of row 0")
    p.add_argument("--against", type=Path, help="another checkout (e.g. main) to compare with")
    p.add_argument("--rounds", type=int, default=6, help="rounds per checkout with --against")
    args = p.parse_args(argv)
    from llm_server.model_source import resolve_model

    model = str(resolve_model(args.model))
    if args.against is not None:
        print("| rows | other checkout | other median ms | other best | this median ms | "
              "this best | this/other (median) | steps each |")  # fmt: skip
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for rows in [int(r) for r in args.rows.split(",")]:
            print(against(model, args.against, rows, args.steps, args.rounds), flush=True)
        return
    print(
        "| rows | eager ms (median) | compiled ms (median) | speed-up | eager best | "
        "compiled best | eager build ms | compiled build ms | eager CPU ms | compiled CPU ms | "
        "max logit diff | same tokens |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        print(_row(measure(model, rows, args.steps, args.prompt)), flush=True)


if __name__ == "__main__":
    main()
