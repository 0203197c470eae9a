"""The real default model (SmolLM2-135M-Instruct) through /v1/responses and /v1/messages: the
same greedy answer as chat, Paris, streamed and not, with the official SDKs."""

from __future__ import annotations

import anthropic
import openai
import pytest

QUESTION = "What is the capital of France?"


@pytest.mark.slow
def test_default_model_answers_paris_on_every_api(default_model_path, live_server):
    srv = live_server(default_model_path, concurrent=2)
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    ant = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    chat = oai.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    kw = dict(model="default", input=QUESTION, max_output_tokens=24, temperature=0)
    assert oai.responses.create(**kw).output_text == answer
    with oai.responses.stream(**kw) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert text == answer
    mkw = dict(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body={"temperature": 0},
    )
    assert ant.messages.create(**mkw).content[0].text == answer
    with ant.messages.stream(**mkw) as stream:
        assert stream.get_final_message().content[0].text == answer
