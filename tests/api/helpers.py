"""Assertions shared by the API tests."""

from __future__ import annotations

import httpx
import numpy as np

from llm_server.decoding import LogitsConstraint

# The tool parameters (and response_format schema) the tool and agent API tests ask for.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    """`resp` has `status` and the OpenAI error body; returns the inner error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in resp.text
    if param is not None:
        assert err["param"] == param
    return err


class ForcedPrefix(LogitsConstraint):
    """Forces `prefix` token by token (each checked against the grammar), then the grammar."""

    def __init__(self, prefix: list[int], grammar: LogitsConstraint) -> None:
        self.prefix, self.grammar, self.i = prefix, grammar, 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        masked = self.grammar.mask(logits)
        if self.i < len(self.prefix):
            assert np.isfinite(masked[self.prefix[self.i]])  # the grammar allows free text
            forced = np.full_like(logits, -np.inf)
            forced[self.prefix[self.i]] = 0.0
            return forced
        return masked

    def advance(self, token: int) -> bool:
        self.i += 1
        return self.grammar.advance(token)


GREEDY = {"temperature": 0}  # the anthropic SDK has no temperature argument any more


def chat_once(oai, text: str, max_tokens: int, system: str | None = None):
    messages = [{"role": "system", "content": system}] if system else []
    r = oai.chat.completions.create(
        model="default",
        messages=[*messages, {"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return r.choices[0], r.usage
