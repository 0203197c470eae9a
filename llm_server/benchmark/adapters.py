"""The same greedy request through /v1/chat/completions, /v1/responses and /v1/messages.

    python -m llm_server.benchmark.adapters [--model DIR] [--runs 15] [--max-tokens 24]

The three APIs share one generation path; this measures what the adapters add (translation,
output items or content blocks) as median request latency, requests interleaved so that load
from elsewhere on the machine falls on all three alike. Default model: the embedded SmolLM2.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

QUESTION = "What is the capital of France?"


def _bodies(max_tokens: int) -> dict[str, tuple[str, dict]]:
    ask = [{"role": "user", "content": QUESTION}]
    greedy = {"temperature": 0}
    return {
        "chat": ("/v1/chat/completions", {"messages": ask, "max_tokens": max_tokens, **greedy}),
        "responses": (
            "/v1/responses",
            {"input": QUESTION, "max_output_tokens": max_tokens, "store": False, **greedy},
        ),
        "messages": ("/v1/messages", {"messages": ask, "max_tokens": max_tokens, **greedy}),
    }


def main(argv: list[str] | None = None) -> int:
    import httpx

    from llm_server.default_model import default_model_path
    from llm_server.testing.live import serving

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    bodies = _bodies(args.max_tokens)
    seconds: dict[str, list[float]] = {name: [] for name in bodies}
    with (
        serving(args.model or default_model_path()) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):
        for path, body in bodies.values():  # warm-up (and the prefix cache for all three)
            http.post(path, json=body).raise_for_status()
        for _ in range(args.runs):
            for name, (path, body) in bodies.items():
                t0 = time.perf_counter()
                http.post(path, json=body).raise_for_status()
                seconds[name].append(time.perf_counter() - t0)
    for name, values in seconds.items():
        print(f"{name:>10}: median {statistics.median(values) * 1000:.1f} ms ({len(values)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
