"""One agent turn against a server: a streaming chat request, its TTFT and the usage it reports.

Cached tokens come from what the server says: OpenAI's `usage.prompt_tokens_details.
cached_tokens`, or llama-server's `timings.cache_n` (with `timings.prompt_n` the tokens it
computed); None where a server says neither. Prefill tok/s is the new tokens (prompt minus
cached) over TTFT, so only where cached tokens are known; prompt tok/s is the whole prompt over
TTFT, for every server.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import httpx

from llm_server.benchmark.load import DONE, sse_chunk

REQUEST_TIMEOUT_S = 1800.0


@dataclass
class TurnResult:
    turn: int  # 1-based
    ttft_s: float | None = None
    total_s: float = 0.0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cache_source: str | None = None  # "usage" | "timings" | None (the server does not say)
    text: str = ""
    error: str | None = None

    @property
    def new_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tok_s(self) -> float | None:
        new = self.new_tokens
        return None if new is None or not self.ttft_s else new / self.ttft_s

    @property
    def prompt_tok_s(self) -> float | None:
        p = self.prompt_tokens
        return None if p is None or not self.ttft_s else p / self.ttft_s

    def as_dict(self) -> dict:
        return {**asdict(self), "new_tokens": self.new_tokens,
                "prefill_tok_s": self.prefill_tok_s, "prompt_tok_s": self.prompt_tok_s}  # fmt: skip


def turn_body(messages: list[dict], max_tokens: int, model: str | None) -> dict:
    """Greedy, streaming, with the final usage chunk; `model` as the server lists it."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    return body


def read_usage(rec: TurnResult, chunk: dict) -> None:
    """Take prompt/cached/completion tokens from a chunk's `usage` or llama-server's `timings`."""
    usage = chunk.get("usage") or {}
    if usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        rec.completion_tokens = int(usage["completion_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        rec.cached_tokens, rec.cache_source = int(cached), "usage"
    timings = chunk.get("timings") or {}
    if timings.get("cache_n") is not None and rec.cache_source != "usage":
        rec.cached_tokens, rec.cache_source = int(timings["cache_n"]), "timings"
        if rec.prompt_tokens is None and timings.get("prompt_n") is not None:
            rec.prompt_tokens = int(timings["cache_n"]) + int(timings["prompt_n"])


def served_model(client: httpx.Client, url: str) -> str | None:
    """The first id of /v1/models (some servers want `model` named), None when not listed."""
    try:
        resp = client.get(f"{url}/v1/models")
        data = resp.json().get("data") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return data[0].get("id") if data and isinstance(data[0], dict) else None


def run_turn(
    client: httpx.Client, url: str, messages: list[dict], turn: int, max_tokens: int,
    model: str | None = None,
) -> TurnResult:  # fmt: skip
    """Send one turn and read its stream to the end."""
    rec = TurnResult(turn)
    parts: list[str] = []
    t0 = time.perf_counter()
    try:
        body = turn_body(messages, max_tokens, model)
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {resp.read().decode()[:300]}"
                return rec
            for line in resp.iter_lines():
                chunk = sse_chunk(line)
                if chunk is None:
                    continue
                if chunk is DONE:
                    break
                if "error" in chunk:
                    rec.error = f"error in stream: {json.dumps(chunk['error'])[:300]}"
                    return rec
                read_usage(rec, chunk)
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if rec.ttft_s is None:
                            rec.ttft_s = time.perf_counter() - t0
                        parts.append(content)
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.total_s = time.perf_counter() - t0
        rec.text = "".join(parts)
    if rec.ttft_s is None and rec.error is None:
        rec.ttft_s = rec.total_s  # no visible text (an immediate EOS): the whole request
    return rec
