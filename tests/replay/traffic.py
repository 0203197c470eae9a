"""The mixed traffic the replay tests record: 20 requests over chat, streams, schemas, scoring."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from replay.sse import aggregate, sse_events

SCHEMA_DIR = Path(__file__).parent.parent / "data" / "schemas"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _chat(content: str, max_tokens: int = 12, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def _schema_chat(name: str) -> dict:
    case = json.loads((SCHEMA_DIR / name).read_text())
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": case["schema"]}}
    return _chat(case["prompt"], max_tokens=40, response_format=fmt)


def mixed_requests() -> list[tuple[str, dict]]:
    """(endpoint, body) for 20 requests; all but the last are deterministic (temperature 0)."""
    return [
        (CHAT, _chat("What is the capital of France?")),
        (CHAT, _chat("Hello, how are you today?", max_tokens=16)),
        (CHAT, _chat("Name three colours.", max_tokens=8, stop=["."])),
        (CHAT, _chat("Count from one to ten.", logprobs=True, top_logprobs=2)),
        (CHAT, {**_chat("Tell me about Berlin."), "max_completion_tokens": 10}),
        (CHAT, _chat("Stream me a greeting.", stream=True)),
        (CHAT, _chat("Stream with usage.", stream=True, stream_options={"include_usage": True})),
        (CHAT, _chat("Stream with logprobs.", stream=True, logprobs=True, top_logprobs=1)),
        (CHAT, _chat("Écris un mot 😀", max_tokens=14, stream=True)),
        (CHAT, _schema_chat("00_person.json")),
        (CHAT, _schema_chat("01_enum_color.json")),
        (CHAT, _schema_chat("02_bounded_integers.json")),
        (
            COMPLETIONS,
            {"prompt": "The capital of France is", "echo": True, "logprobs": 1, "max_tokens": 0},
        ),
        (
            COMPLETIONS,
            {
                "prompt": ["One two three", "Hello, how are you"],
                "echo": True,
                "logprobs": 3,
                "max_tokens": 0,
            },
        ),
        (
            COMPLETIONS,
            {"prompt": [5, 17, 42, 99, 100], "echo": True, "logprobs": 0, "max_tokens": 0},
        ),
        (COMPLETIONS, {"prompt": "def main():", "echo": True, "logprobs": 2, "max_tokens": 1}),
        (COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}),
        (
            COMPLETIONS,
            {"prompt": "Continuous batching", "max_tokens": 10, "temperature": 0, "logprobs": 2},
        ),
        (COMPLETIONS, {"prompt": ["A", "B C"], "max_tokens": 8, "temperature": 0, "stream": True}),
        (CHAT, {**_chat("Say something random.", max_tokens=8), "temperature": 0.9}),
    ]


def send_all(url: str, headers: dict[str, str] | None = None) -> list[tuple[int, dict]]:
    """Send the mixed requests one after another; (status, body) with streams aggregated."""
    out = []
    with httpx.Client(base_url=url, timeout=120, headers=headers or {}) as client:
        for endpoint, body in mixed_requests():
            resp = client.post(endpoint, json=body)
            if body.get("stream"):
                out.append((resp.status_code, aggregate(endpoint, sse_events(resp.content))))
            else:
                out.append((resp.status_code, resp.json()))
    return out
