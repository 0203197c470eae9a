"""Prompt tok/s of a lone long prompt through the batch scheduler (issue 38, Deliver 2), and
llama-server's on the same prompt ids in the same run.

    python -m llm_server.native.blas .venv/bin/python -m llm_server.benchmark.prefill_rate \
        [--model PATH] [--tokens 2048 8000] [--prefill 128 512] [--repeats 2] \
        [--llama-server BIN --gguf FILE [--llama-threads 2]]

Each measurement runs in a fresh process (the servers' env, so the BLAS preload and thread
settings are theirs): the MLX engine as the server loads it, a `BatchScheduler` with
`--step-tokens` 128 and the given `prefill_tokens` (128: the old rule, every step 128
positions), one warm-up request, then one request of N random prompt tokens and
`max_tokens` 1, timed from submit to its finish. The warm-up is 64 tokens (a server's first long
prompt: ours then grows its KV store for the prompt, for every row, in fresh memory), or with
`--warm-store` N other random tokens (a server that has served such a prompt before: no fresh
memory, as llama-server, which allocates its KV cache at start). The settings alternate within each repeat
(a, b, a, b), so a shared machine's drift hits both. Prints one JSON line per measurement and a
summary table (median over repeats) at the end. The greedy first token is printed too: it must
be the same at every prefill budget.

With `--llama-server`, each repeat also starts llama-server (`-t`/`-tb` `--llama-threads`, one
slot, context for the longest prompt, its default batch sizes) on `--gguf` (the same weights in
F32: docs/performance.md, "Against llama.cpp's llama-server"), after ours at each length: one
warm-up, then the same N prompt ids through /completion with `n_predict` 1 and `cache_prompt`
false; its rate is `timings.prompt_per_second` (prompt evaluation only, as ours is timed on the
scheduler without HTTP). The table adds llama-server's median and ours/llama-server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llm_server.benchmark.servers import add_llama_server_args, llama_server_cmd

WARMUP_TOKENS = 64


def _prompts(tokens: int, vocab: int, warm_store: bool = False) -> tuple[list[int], list[int]]:
    """The warm-up prompt and the measured one (the same ids on every server). A warm-up as
    long as the measured prompt starts with another token, so no prefix of it is reused."""
    import numpy as np

    rng = np.random.default_rng(tokens)
    vocab = min(vocab, 30000)
    warmup = rng.integers(100, vocab, WARMUP_TOKENS).tolist()
    measured = rng.integers(100, vocab, tokens).tolist()
    if warm_store:
        warmup = rng.integers(100, vocab, tokens).tolist()
        warmup[0] = 99  # below every measured id
    return warmup, measured


def _measure_here(
    model: Path, tokens: int, prefill: int, step: int, rows: int, warm_store: bool = False
) -> dict:
    from llm_server.decoding import Decoder, SamplingParams
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.scheduler import BatchScheduler, GenerationRequest
    from llm_server.scheduler.request import FinishEvent

    sched = BatchScheduler(
        lambda: MLXEngine(model, EngineSettings(rows=rows)),
        max_concurrent=rows,
        step_tokens=step,
        prefill_tokens=prefill,
    ).start()
    engine = sched.wait_ready(600)
    warmup, measured = _prompts(tokens, engine.vocab_size, warm_store)

    def serve(prompt: list[int]) -> tuple[float, list[int]]:
        done, got = [], []

        def emit(ev) -> None:
            (done if isinstance(ev, FinishEvent) else got).append(ev)

        decoder = Decoder(SamplingParams(max_tokens=1, temperature=0.0), (), lambda ids: "")
        t0 = time.perf_counter()
        sched.submit(GenerationRequest(prompt=prompt, decoder=decoder, emit=emit))
        while not done:
            time.sleep(0.002)
        return time.perf_counter() - t0, [e.token_id for e in got]

    try:
        serve(warmup)
        seconds, first = serve(measured)
    finally:
        sched.close(30)
    return {
        "tokens": tokens,
        "prefill_tokens": prefill,
        "step_tokens": step,
        "warm_store": warm_store,
        "seconds": round(seconds, 3),
        "prompt_tok_s": round(tokens / seconds, 1),
        "first_token": first,
    }


def measure(
    model: Path, tokens: int, prefill: int, step: int = 128, rows: int = 4, warm_store: bool = False
) -> dict:
    """One measurement in a fresh process."""
    args = [str(model), str(tokens), str(prefill), str(step), str(rows), str(int(warm_store))]
    cmd = [sys.executable, "-m", "llm_server.benchmark.prefill_rate", "--child", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"prefill at {tokens} tokens failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_llama(cmd: str, tokens: int, vocab: int, log: Path, warm_store: bool = False) -> dict:
    """llama-server's prompt rate on the same ids, in a fresh server (`cmd`: a peer template)."""
    import httpx

    from llm_server.benchmark.servers import ServerSpec, running

    warmup, measured = _prompts(tokens, vocab, warm_store)
    spec = ServerSpec("llama_server", Path("-"), concurrency=1, max_queued=1, peer_cmd=cmd)
    with running(spec, log) as srv, httpx.Client(base_url=srv.url, timeout=1800) as client:
        for prompt in (warmup, measured):
            body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0,
                    "return_tokens": True}  # fmt: skip
            t0 = time.perf_counter()
            resp = client.post("/completion", json=body)
            wall = time.perf_counter() - t0
            resp.raise_for_status()
    timings = resp.json()["timings"]
    return {
        "server": "llama-server",
        "tokens": tokens,
        "warm_store": warm_store,
        "prompt_n": timings["prompt_n"],
        "seconds": round(timings["prompt_ms"] / 1000, 3),
        "wall_s": round(wall, 3),
        "prompt_tok_s": round(timings["prompt_per_second"], 1),
        "first_token": resp.json().get("tokens", [])[:1],
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        model, tokens, prefill, step, rows, warm = argv[1:7]
        ints = (int(tokens), int(prefill), int(step), int(rows))
        print(json.dumps(_measure_here(Path(model), *ints, warm_store=warm == "1")))
        return
    p = argparse.ArgumentParser(prog="prefill_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8000])
    p.add_argument("--prefill", type=int, nargs="+", default=[128, 512])
    p.add_argument("--step-tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=4, help="engine rows (--concurrent-requests)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--warm-store",
        action="store_true",
        help="warm up with a prompt as long as the measured one (other ids), not 64 tokens",
    )
    add_llama_server_args(p)
    p.add_argument("--logs", type=Path, default=Path("benchmark-results/prefill_rate"))
    args = p.parse_args(argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    cmd = llama_server_cmd(p, args, ctx=max(args.tokens) + 256)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    results: dict[tuple[int, int], list[dict]] = {}
    for _ in range(args.repeats):
        for n in args.tokens:
            for prefill in args.prefill:
                r = measure(args.model, n, prefill, args.step_tokens, args.rows, args.warm_store)
                print(json.dumps(r), flush=True)
                results.setdefault((n, prefill), []).append(r)
            if cmd:
                r = measure_llama(
                    cmd, n, vocab, args.logs / f"llama-server-{n}.log", args.warm_store
                )
                print(json.dumps(r), flush=True)
                results.setdefault((n, -1), []).append(r)
    print(summary(results))


def summary(results: dict[tuple[int, int], list[dict]]) -> str:
    """Median seconds and tok/s per (tokens, prefill budget); llama-server's rows (budget -1)
    as `llama`, and each of ours over it."""
    lines = [
        f"{'tokens':>7} {'prefill':>8} {'median s':>9} {'tok/s':>8} {'/llama':>7}  first token"
    ]
    for (n, prefill), rs in sorted(results.items()):
        s = statistics.median(r["seconds"] for r in rs)
        llama = results.get((n, -1))
        ratio = ""
        if llama and prefill != -1:
            ratio = f"{statistics.median(r['seconds'] for r in llama) / s:.2f}x"
        firsts = sorted({str(r["first_token"]) for r in rs})
        label = "llama" if prefill == -1 else str(prefill)
        lines.append(f"{n:>7} {label:>8} {s:>9.2f} {n / s:>8.1f} {ratio:>7}  {', '.join(firsts)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
