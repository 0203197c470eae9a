"""/v1/completions scoring (echo + logprobs, C5): the request routing and the response shape."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture
def score_calls(server, monkeypatch):
    """Record what the route hands the real scorer, and what it got back."""
    calls = []
    real = server.service.score

    async def score(prompts, top_k, generate_one):
        result = await real(prompts, top_k, generate_one)
        calls.append(((prompts, top_k, generate_one), result))
        return result

    monkeypatch.setattr(server.service, "score", score)
    return calls


def test_scoring_request_routing_and_shape(http, server, score_calls):
    tok = server.service.tokenizer
    ids = tok.encode("hello world", add_special_tokens=False)
    body = {"prompt": [ids, "colour"], "echo": True, "logprobs": 2, "max_tokens": 1}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    # All prompts in one call; token ids passed as given (no BOS), text with default specials.
    [(args, scored)] = score_calls
    assert args == ([ids, tok.encode("colour")], 2, True)
    data = resp.json()
    assert data["object"] == "text_completion"
    texts = [tok.decode(ids, skip_special_tokens=False), "colour"]
    for choice, prompt_ids, text, sp in zip(
        data["choices"], [ids, tok.encode("colour")], texts, scored, strict=True
    ):
        lp = choice["logprobs"]
        assert sp.tokens[:-1] == prompt_ids and sp.generated == sp.tokens[-1]
        assert choice["finish_reason"] == "length"
        assert choice["text"] == text + tok.decode([sp.generated])
        assert lp["tokens"] == tok.token_strings(sp.tokens)
        assert lp["token_logprobs"] == sp.token_logprobs and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        for got, top in zip(lp["top_logprobs"][1:], sp.top_logprobs[1:], strict=True):
            names = tok.token_strings([t for t, _ in top])
            assert 1 <= len(got) <= 2
            assert got[names[0]] == top[0][1]  # the best alternative, under its token string
        offsets = [0]
        for s in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(s))
        assert lp["text_offset"] == offsets
    n_prompt = len(ids) + len(tok.encode("colour"))
    assert data["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 2,
        "total_tokens": n_prompt + 2,
    }


def test_scoring_max_tokens_zero(http, score_calls):
    resp = http.post(
        "/v1/completions", json={"prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 0}
    )
    assert resp.status_code == 200
    assert score_calls[0][0][1:] == (0, False)
    choice = resp.json()["choices"][0]
    assert choice["text"] == "abc" and choice["logprobs"]["token_logprobs"][0] is None
    assert resp.json()["usage"]["completion_tokens"] == 0


def test_echo_without_logprobs_is_generation(http, score_calls):
    resp = http.post("/v1/completions", json={"prompt": "abc", "echo": True, "max_tokens": 0})
    assert resp.json()["choices"][0]["text"] == "abc"
    assert score_calls == []


def test_scoring_end_to_end(server, http):
    """Real scorer: arrays cover prompt + generated token; the generated token's logprob
    matches what generation reports for it."""
    tok = server.service.tokenizer
    ids = tok.encode("The capital of France is", add_special_tokens=False)
    body = {
        "prompt": [ids, ids[:3]],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
    }
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    parsed = client.completions.create(model="default", **body)
    first = parsed.choices[0].logprobs
    assert len(first.tokens) == len(first.token_logprobs) == len(first.top_logprobs) == len(ids) + 1
    assert first.token_logprobs[0] is None and first.top_logprobs[0] is None
    gen = http.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1}
    )
    glp = gen.json()["choices"][0]["logprobs"]
    assert first.tokens[-1] == glp["tokens"][0]
    assert first.token_logprobs[-1] == pytest.approx(glp["token_logprobs"][0], abs=1e-4)
    alone = http.post("/v1/completions", json={**body, "prompt": ids[:3]}).json()
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        resp.json()["choices"][1]["logprobs"]["token_logprobs"], abs=1e-4
    )
