"""Two ranks on localhost against one process: the served rate and whether the text agrees.

`python -m llm_server.native.blas python -m llm_server.benchmark.distributed [RANKS] [MAX_TOKENS]`
builds a tiny 4-layer checkpoint, starts RANKS ranks (`--distributed ring`, a hostfile of
127.0.0.1 entries) tensor-parallel, then pipeline-parallel (`--pipeline`), then one in-process
server, sends the same 8 greedy completions 4 at a time to each and prints one JSON object. On
one box the ranks share the cores and every collective is a loopback round trip, so this
measures the lock-step overhead, not a cluster.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ["Hello", "The capital of France", "def main():", "One two three"] * 2


def _load(url: str, max_tokens: int) -> tuple[list[str], float]:
    import httpx

    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]

    def one(prompt: str) -> tuple[str, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
        return r["choices"][0]["text"], r["usage"]["completion_tokens"]

    one("warm up")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(one, PROMPTS))
    return [t for t, _ in out], sum(n for _, n in out) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    from llm_server.testing.live import serving
    from llm_server.testing.ranks import start_ranks
    from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 2
    max_tokens = int(args[1]) if len(args) > 1 else 64
    work = Path(tempfile.mkdtemp())
    spec = TinySpec(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                    intermediate_size=768)  # fmt: skip
    model = build_tiny_checkpoint(work / "tiny", spec)
    texts, rates = {}, {}
    for mode, extra in (("tensor", ()), ("pipeline", ("--pipeline",))):
        ranks = start_ranks(model, work, n, extra)
        try:
            texts[mode], rates[mode] = _load(ranks.url, max_tokens)
        finally:
            ranks.stop()
    with serving(model, 4) as server:
        alone, alone_rate = _load(server.url, max_tokens)
    result = {
        "ranks": n,
        "tensor_tok_s": round(rates["tensor"], 1),
        "pipeline_tok_s": round(rates["pipeline"], 1),
        "one_process_tok_s": round(alone_rate, 1),
        "same_text": {mode: text == alone for mode, text in texts.items()},
    }
    print(json.dumps(result))
    return 0 if all(result["same_text"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
