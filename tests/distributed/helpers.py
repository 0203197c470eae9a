"""What the two-rank tests ask a server: concurrent greedy completions and prompt scores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

PROMPTS = ["Hello", "The capital of France", "def main():", "One two three"]


def model_id(url: str) -> str:
    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def complete(url: str, prompts: list[str], max_tokens: int = 16) -> list[tuple[str, int, str]]:
    """(text, completion tokens, finish reason) of each prompt, all sent at once (they batch)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = model_id(url)

    def one(prompt: str):
        c = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
        )
        return c.choices[0].text, c.usage.completion_tokens, c.choices[0].finish_reason

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def score(url: str, prompt: str) -> list[float]:
    """The prompt's token log-probs (echo, max_tokens 0), first token left out."""
    r = httpx.post(
        url + "/v1/completions",
        json={
            "model": model_id(url),
            "prompt": prompt,
            "max_tokens": 0,
            "echo": True,
            "logprobs": 2,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]


def assert_answers_as_one_process(url: str, alone_url: str) -> dict:
    """The group at url gives one process's completions and scores (greedy, batched), and a
    prompt extending a finished one hits the prefix cache; returns the group's /health."""
    group = complete(url, PROMPTS)
    assert group == complete(alone_url, PROMPTS)
    assert all(n >= 1 for _, n, _ in group)
    for prompt in ("The capital of France is Paris.", PROMPTS[2]):
        got, want = score(url, prompt), score(alone_url, prompt)
        assert len(got) == len(want) >= 4
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
    # a prompt extending a finished one starts from the prefix cache, on every rank alike
    longer = [PROMPTS[1] + " is a city of"]
    assert complete(url, longer) == complete(alone_url, longer)
    health = httpx.get(url + "/health").json()
    assert health["prefix_cache"]["hits"] >= 1
    return health
