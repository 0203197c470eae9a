"""KV formats against float32 KV on one model, in one run (issue 48 item 3, docs/performance.md).

`python -m llm_server.benchmark.kv_formats [--model PATH]` (default: the embedded SmolLM2)
loads the engine once per KV format (float32, float16, 8-bit, 4-bit; groups of 64) as the
server does and prints one JSON object:
- `bytes_per_token`: KV bytes one position of one row takes (`MLXEngine.kv_token_bytes`);
- `drift`: greedy agreement: of the benchmark's 32 chat prompts (llm_server/benchmark/
  prompts.json, through the chat template) decoded `--greedy-tokens` tokens, how many equal
  float32 KV's whole answer, and the mean share of tokens before the first difference; on the
  scoring set (each prompt followed by float32 KV's answer, scored on the scoring rows), the
  largest and mean |log-prob - float32 KV's| per format;
- `rate`: decode tokens/s at each concurrency (rows of `--history`-token prompts, the median
  of `--steps` batched steps), the formats taking turns round by round so a busy host slows
  them alike.

`--memory N` instead measures memory: per format, in a fresh process each, one row prefilled
with N positions and decoded 8 steps: the KV held, the RSS growth after it (MLX's cache
cleared), MLX's peak and the process's peak RSS (MB).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

FORMATS = {
    "float32": {},
    "float16": {"kv_dtype": "float16"},
    "int8": {"kv_bits": 8},
    "int4": {"kv_bits": 4},
}
SCORE_CHUNK = 64  # positions of a scoring chunk


def _chats() -> list[list[dict]]:
    data = json.loads((Path(__file__).parent / "prompts.json").read_text())
    return [item["messages"] for item in data["prompts"]]


def _score(engine, ids: list[int]) -> np.ndarray:
    """Log-probs [len(ids) - 1] of each next token, on the engine's first scoring row."""
    from llm_server.engines.plan import ScoreChunk, StepPlan

    row, parts = engine.rows, []
    for start in range(0, len(ids), SCORE_CHUNK):
        chunk = ScoreChunk(1, row, ids, start, min(start + SCORE_CHUNK, len(ids)), 0)
        parts.append(engine.run(StepPlan(score=(chunk,))).scores[row].token_logprobs)
    engine.release(row)
    return np.concatenate(parts, axis=1)[0, :-1]


def _greedy(engine, ids: list[int], n: int) -> list[int]:
    logits, out = engine.prefill(0, ids), []
    while len(out) < n:
        out.append(int(np.argmax(logits)))
        logits = engine.decode([0], [out[-1]])[0]
    engine.release(0)
    return out


def _step_s(engine, rows: int, history: int, steps: int, seed: int) -> float:
    """Median seconds of a batched decode step of `rows` rows over `history`-token prompts."""
    rng = np.random.default_rng(seed)
    for row in range(rows):
        engine.prefill(row, rng.integers(3, min(1000, engine.vocab_size), history).tolist())
    all_rows, tokens = list(range(rows)), list(range(5, 5 + rows))
    for _ in range(3):  # warm-up: first shapes, allocations, compiled graphs
        tokens = engine.decode(all_rows, tokens).argmax(-1).tolist()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = engine.decode(all_rows, tokens).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    for row in all_rows:
        engine.release(row)
    return float(np.median(times))


def run(args: argparse.Namespace) -> dict:
    from llm_server.default_model import default_model_path
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.scheduler.scorer import Scorer
    from llm_server.tokenizer import Tokenizer

    model = Path(args.model) if args.model else default_model_path()
    rows = max(args.concurrency)
    engines = {}
    for name, kw in FORMATS.items():
        settings = EngineSettings(rows=rows, prefix_cache_bytes=0, kv_keep_alive=0, **kw)
        engines[name] = MLXEngine(model, settings)
        Scorer().attach(engines[name])  # scoring rides on the scoring rows
    tok = Tokenizer(model)
    prompts = [tok.apply_chat_template(m) for m in _chats()]
    n = args.greedy_tokens
    answers = {name: [_greedy(e, p, n) for p in prompts] for name, e in engines.items()}
    texts = [p + a for p, a in zip(prompts, answers["float32"], strict=True)]
    scores = {name: [_score(e, ids) for ids in texts] for name, e in engines.items()}
    drift = {}
    for name in FORMATS:
        diff = np.concatenate(
            [np.abs(a - b) for a, b in zip(scores[name], scores["float32"], strict=True)]
        )
        same = [a == b for a, b in zip(answers[name], answers["float32"], strict=True)]
        prefix = []
        for a, b in zip(answers[name], answers["float32"], strict=True):
            k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            prefix.append(k / len(a))
        drift[name] = {
            "max_abs_logprob_diff": float(diff.max()),
            "mean_abs_logprob_diff": float(diff.mean()),
            "greedy_identical": f"{sum(same)}/{len(same)}",
            "greedy_shared_prefix": float(np.mean(prefix)),
        }
    times: dict[str, dict[int, list[float]]] = {
        n: {c: [] for c in args.concurrency} for n in FORMATS
    }
    for r in range(args.rounds):
        for c in args.concurrency:
            for name, engine in engines.items():
                times[name][c].append(_step_s(engine, c, args.history, args.steps, seed=r))
    rate = {
        name: {str(c): round(c / float(np.median(ts)), 1) for c, ts in per.items()}
        for name, per in times.items()
    }
    return {
        "model": str(model),
        "kernels": engines["float32"].kernels_name,
        "formats": {n: e.kv_format.name for n, e in engines.items()},
        "bytes_per_token": {n: e.kv_token_bytes() for n, e in engines.items()},
        "scoring_set": {"texts": len(texts), "positions": int(sum(len(t) - 1 for t in texts))},
        "drift": drift,
        "history": args.history,
        "rate_tokens_per_s": rate,
        "rate_vs_float32": {
            n: {c: round(v / rate["float32"][c], 2) for c, v in per.items()}
            for n, per in rate.items()
        },
    }


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return (int(f.read().split()[1]) * resource.getpagesize()) >> 20


def _memory_here(model: str | None, fmt: str, positions: int) -> dict:
    """One format's memory at `positions` of one row (run in its own process)."""
    import mlx.core as mx

    from llm_server.default_model import default_model_path
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    path = Path(model) if model else default_model_path()
    engine = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=0, **FORMATS[fmt]))
    mx.clear_cache()
    base = _rss_mb()
    ids = np.random.default_rng(0).integers(3, engine.vocab_size, positions).tolist()
    token = int(np.argmax(engine.prefill(0, ids)))
    for _ in range(8):
        token = int(np.argmax(engine.decode([0], [token])[0]))
    held = engine.kv_bytes() >> 20
    mx.clear_cache()
    return {
        "format": engine.kv_format_name,
        "kv_held_mb": held,
        "rss_growth_mb": _rss_mb() - base,
        "mlx_peak_mb": mx.get_peak_memory() >> 20,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,  # KiB on Linux
    }


def memory(model: str | None, positions: int) -> list[dict]:
    """`_memory_here` for every format, each in a fresh process (peaks are per process)."""
    out = []
    for fmt in FORMATS:
        argv = [sys.executable, "-m", "llm_server.benchmark.kv_formats", "--memory-one", fmt]
        argv += ["--memory", str(positions)] + (["--model", model] if model else [])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=True)
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8]
    )
    p.add_argument("--history", type=int, default=512, help="prompt tokens per row of the rate")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per measurement")
    p.add_argument(
        "--rounds", type=int, default=3, help="turns of every format at every concurrency"
    )
    p.add_argument("--greedy-tokens", type=int, default=64, help="tokens of each greedy answer")
    p.add_argument("--memory", type=int, metavar="N", help="measure memory at N positions instead")
    p.add_argument("--memory-one", choices=sorted(FORMATS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_one:
        print(json.dumps(_memory_here(args.model, args.memory_one, args.memory)))
    elif args.memory:
        print(json.dumps(memory(args.model, args.memory), indent=1))
    else:
        print(json.dumps(run(args), indent=1))


if __name__ == "__main__":
    main()
