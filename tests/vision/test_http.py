"""A vision-language checkpoint behind the real HTTP server: text requests on the three chat
APIs are its language model's answers (the image parts on the wire are the API parsers')."""

from __future__ import annotations

import httpx
import pytest

from llm_server.testing.vision import VLM_FAMILIES
from tests.vision.helpers import answer, ask, chat


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_text_request_over_http_answers_as_the_language_model(family, vlm_paths, live_server):
    """Plain-string content, which SmolVLM's own template would render as nothing: the answer
    is the one the chat path gives the same text as a part, token for token."""
    srv = live_server(vlm_paths[family], 2)
    body = {
        "messages": [{"role": "user", "content": "Hello, how are you today?"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
    }
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]
    want, finish = answer(srv.service, chat([ask(None, "Hello, how are you today?")], 8))
    assert len(got) == len(want) == 8
    assert r.json()["usage"]["prompt_tokens"] == finish.prompt_tokens
    assert got == srv.service.tokenizer.token_strings(want)
