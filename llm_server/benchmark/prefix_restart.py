"""TTFT of a conversation's turn: cold, an in-memory prefix-cache hit, and read back from the
disk tier (`--prefix-cache-dir`) after a restart, on the default model over streaming chat.

    python -m llm_server.native.blas python -m llm_server.benchmark.prefix_restart [PROMPT_TOKENS]

Turn 2 runs on the server that ran turn 1 (in-memory hit); the server restarts over the same
folder, answers one short unrelated request (the first forwards' warm-up, which turn 2 also had
behind it) and runs turn 3 (disk hit); a server with the cache off runs turns 2 and 3 cold.
Every server has the default 4 rows (`--concurrent-requests`), so the unrelated request takes
another row than the conversation's.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llm_server.default_model import default_model_path
from llm_server.testing.live import serving


def _ttft(srv, messages: list[dict]) -> tuple[float, str, dict]:
    body = {
        "messages": messages,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, text, usage = time.perf_counter(), None, "", {}
    with (
        httpx.Client(base_url=srv.url, timeout=900) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - start
                text += piece
    return first or 0.0, text, usage


ROWS = 4  # llm-server's default --concurrent-requests


def main(tokens: int = 3000) -> None:
    path = default_model_path()
    rules = " ".join(f"rule{i}: keep edits small and run the tests;" for i in range(tokens // 10))
    system = {"role": "system", "content": "You are a coding agent. " + rules}
    folder = Path(tempfile.mkdtemp())
    one = [system, {"role": "user", "content": "list the files"}]
    with serving(path, ROWS, prefix_cache_dir=folder) as srv:
        t1, a1, _ = _ttft(srv, one)
        two = one + [{"role": "assistant", "content": a1}, {"role": "user", "content": "open it"}]
        t2, a2, u2 = _ttft(srv, two)
    three = two + [{"role": "assistant", "content": a2}, {"role": "user", "content": "run tests"}]
    with serving(path, ROWS, prefix_cache_dir=folder) as srv:
        _ttft(srv, [{"role": "user", "content": "hi"}])
        t3, a3, u3 = _ttft(srv, three)
        stats = srv.service.prefix_cache_stats()
    with serving(path, ROWS, prefix_cache_bytes=0) as srv:
        c2, b2, _ = _ttft(srv, two)
        c3, b3, _ = _ttft(srv, three)
    print(f"turn 1 (cold, {t1:.2f} s): the conversation starts")
    for name, t, c, u, same in (
        ("turn 2, in-memory hit", t2, c2, u2, a2 == b2),
        ("turn 3, disk tier after a restart", t3, c3, u3, a3 == b3),
    ):
        cached = u["prompt_tokens_details"]["cached_tokens"]
        print(
            f"{name}: TTFT {t:.3f} s, cold {c:.3f} s; prompt {u['prompt_tokens']} tokens, "
            f"cached {cached}; same answer as cold: {same}"
        )
    print(f"disk read {stats.disk_read_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
