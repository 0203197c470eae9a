"""The real embedded default (SmolLM2-135M-Instruct) served through our own engine and HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.mark.slow
@pytest.mark.parametrize("concurrent", [1, 4])
def test_default_model_answers_paris_streamed_equals_non_streamed(
    default_model_path, live_server, concurrent
):
    srv = live_server(default_model_path, concurrent=concurrent)
    body = {"messages": [QUESTION], "temperature": 0, "max_tokens": 24}
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        full = client.post("/v1/chat/completions", json=body).json()
        answer = full["choices"][0]["message"]["content"]
        assert "Paris" in answer
        streamed = ""
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        streamed += chunk["choices"][0]["delta"].get("content") or ""
    assert streamed == answer
