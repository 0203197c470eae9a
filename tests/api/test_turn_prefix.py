"""Every turn of a conversation reuses its prefix, on each API (issue 38, over real HTTP).

Five turns on chat (history resent), completions (token-id prompts, streamed and not),
Responses (`previous_response_id`, and stateless replays with `store: false` resending the
output items) and Messages (history resent, `cache_control` marks): from turn 2 on, the prompt tokens the prefix cache gave (`cached_tokens`,
`cache_read_input_tokens`) are at least 95% of the previous turn's prompt, and every answer
is the one a server with the cache off gives (greedy). Two templates: Hermes tools (turn 2 is a
forced call, turn 3 sends its result) and Qwen3-style thinking (answers all reasoning, cut by
the token limit: the history shows them without it).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from llm_server.testing.live import serving
from llm_server.testing.tiny import HERMES_TEMPLATE, THINKING_TEMPLATE, build_tiny_checkpoint

TURNS = 5
SYSTEM = "You are a helpful assistant for the weather desk. " * 6
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Berlin"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CALL_TURN = 1  # the turn (from 0) whose answer must be a tool call
ANSWER_TOKENS, CALL_TOKENS = 12, 64  # the tiny BPE spells the call's JSON a character a time


def _limit(t: int) -> int:
    return CALL_TOKENS if t == CALL_TURN else ANSWER_TOKENS


def _chat(c: httpx.Client, api: str) -> list[tuple[int, int, object]]:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{api} 0"}]
    out = []
    for t in range(TURNS):
        body = {"messages": msgs, "max_tokens": _limit(t), "temperature": 0, "tools": tools}
        if t == CALL_TURN:
            body["tool_choice"] = "required"
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        usage, msg = r.json()["usage"], r.json()["choices"][0]["message"]
        calls = [(k["function"]["name"], k["function"]["arguments"]) for k in msg.get("tool_calls") or []]  # fmt: skip
        seen = (msg["content"], msg.get("reasoning_content"), calls)
        out.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], seen))
        msgs.append({k: v for k, v in msg.items() if v is not None and k != "reasoning"})
        if msg.get("tool_calls"):
            msgs.append({"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "21 C"})  # fmt: skip
        else:
            msgs.append({"role": "user", "content": f"{api} {t + 1}"})
    return out


def _items(output: list[dict]) -> list:
    """Output items without their ids."""
    return [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in output]


def _responses(c: httpx.Client, api: str) -> list[tuple[int, int, object]]:
    tools = [{"type": "function", "name": "weather", "parameters": SCHEMA}]
    stateless = api == "responses-stateless"
    items, prev, out = [{"role": "user", "content": f"{api} 0"}], None, []
    for t in range(TURNS):
        body = {"instructions": SYSTEM, "input": items, "max_output_tokens": _limit(t)}
        body |= {"temperature": 0, "tools": tools}
        if t == CALL_TURN:
            body["tool_choice"] = "required"
        if stateless:
            body |= {"store": False, "include": ["reasoning.encrypted_content"]}
        elif prev is not None:
            body["previous_response_id"] = prev
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        resp = r.json()
        usage, prev = resp["usage"], resp["id"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        out.append((usage["input_tokens"], cached, _items(resp["output"])))
        items = items + resp["output"] if stateless else []
        calls = [o for o in resp["output"] if o["type"] == "function_call"]
        if calls:
            items.append({"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "21 C"})  # fmt: skip
        else:
            items.append({"role": "user", "content": f"{api} {t + 1}"})
    return out


def _messages(c: httpx.Client, api: str) -> list[tuple[int, int, object]]:
    mark = {"type": "ephemeral"}
    system = [{"type": "text", "text": SYSTEM, "cache_control": mark}]
    tools = [{"name": "weather", "input_schema": SCHEMA}]
    msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": f"{api} 0", "cache_control": mark}]}]  # fmt: skip
    out = []
    for t in range(TURNS):
        body = {"model": "default", "system": system, "messages": msgs, "tools": tools}
        body |= {"max_tokens": _limit(t), "temperature": 0}
        if t == CALL_TURN:
            body["tool_choice"] = {"type": "any"}
        r = c.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text
        m = r.json()
        u = m["usage"]
        prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        blocks = [{k: v for k, v in b.items() if k != "id"} for b in m["content"]]
        out.append((prompt, u["cache_read_input_tokens"], blocks))
        msgs.append({"role": "assistant", "content": m["content"]})
        uses = [b for b in m["content"] if b["type"] == "tool_use"]
        if uses:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"], "content": "21 C"}]})  # fmt: skip
        else:
            msgs.append({"role": "user", "content": [{"type": "text", "text": f"{api} {t + 1}", "cache_control": mark}]})  # fmt: skip
    return out


def _completions(c: httpx.Client, api: str) -> list[tuple[int, int, object]]:
    """Token-id prompts, each turn the last one plus new ids; odd turns streamed with usage."""
    ids, out = [(7 * i) % 200 + 10 for i in range(120)], []
    for t in range(TURNS):
        body = {"prompt": ids, "max_tokens": ANSWER_TOKENS, "temperature": 0}
        if t % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: {")]
            chunks = [json.loads(ln) for ln in lines]
            text, usage = "".join(k["choices"][0]["text"] for k in chunks[:-1]), chunks[-1]["usage"]
        else:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
        out.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], text))
        ids = ids + [(11 * t + j) % 150 + 20 for j in range(9)]
    return out


APIS: dict[str, Callable[[httpx.Client, str], list]] = {
    "chat": _chat,
    "completions": _completions,
    "responses": _responses,
    "responses-stateless": _responses,
    "messages": _messages,
}


@pytest.fixture(scope="module", params=["hermes", "think"])
def runs(request, tmp_path_factory) -> tuple[str, dict, dict, int]:
    """Every API's conversation on a server with the prefix cache and on one without, and the
    tokens of the generation prompt's tail a history does not show (the opening `<think>`)."""
    template = {"hermes": HERMES_TEMPLATE, "think": THINKING_TEMPLATE}[request.param]
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}", chat_template=template
    )
    results = {}
    for label, kw in (("warm", {}), ("cold", {"prefix_cache_bytes": 0})):
        with serving(path, **kw) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            results[label] = {api: run(c, api) for api, run in APIS.items()}
            tail = len(srv.service.tokenizer.encode("<think>\n", add_special_tokens=False))
    tail *= request.param == "think"
    return request.param, results["warm"], results["cold"], tail


@pytest.mark.parametrize("api", list(APIS))
def test_each_turn_reuses_the_previous_prompt(runs, api):
    """All of it but the generation prompt's tail when the history does not show that."""
    template, warm, cold, tail = runs
    turns = warm[api]
    for n in range(1, TURNS):
        prompt, cached = turns[n][:2]
        previous = turns[n - 1][0]
        assert cached >= 0.95 * previous, (template, api, n + 1, cached, previous)
        assert cached >= previous - tail, (template, api, n + 1, cached, previous)
        assert cached < prompt  # the last prompt token is always computed (its logits)
    assert all(cached == 0 for _, cached, _ in cold[api])  # the cache off reports none


@pytest.mark.parametrize("api", list(APIS))
def test_answers_are_the_cold_servers(runs, api):
    """Same greedy answers turn by turn, and the same prompt lengths (nothing re-rendered)."""
    template, warm, cold, _ = runs
    assert [(p, seen) for p, _, seen in warm[api]] == [(p, seen) for p, _, seen in cold[api]]
    if (
        template == "hermes" and api != "completions"
    ):  # the forced call was made (its result sent next)
        assert "weather" in str(warm[api][CALL_TURN][2])
