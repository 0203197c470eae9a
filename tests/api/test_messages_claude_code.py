"""/v1/messages as Claude Code 2.1.x calls it, on a live tiny-checkpoint server (1,024 positions).

Claude Code's first request: `?beta=true`, an `anthropic-beta` header, system blocks with
`cache_control` (the first its attribution line), a `role: "system"` message inside `messages`,
`thinking: adaptive`, `output_config`, `context_management`, `metadata.user_id`, tools with
`cache_control`, `max_tokens` 32000, `stream: true`. The official anthropic SDK and raw httpx.
"""

from __future__ import annotations

import base64
import io
import json

import anthropic
import httpx
import pytest
from PIL import Image

from llm_server.api.anthropic.system import place_system, renders_system_in_place
from llm_server.testing.tiny import build_tiny_checkpoint
from llm_server.tokenizer import Tokenizer
from tests.api.helpers import GREEDY, WEATHER_SCHEMA

CACHE = {"type": "ephemeral"}
BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "prompt-caching-scope-2026-01-05,effort-2025-11-24"
)
HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": BETAS,
    "x-app": "cli",
    "user-agent": "claude-cli/2.1.197 (external, cli)",
}
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli; cch=0f3e2;"
SKILLS = "The following skills are available: commit, review."
BASH = {
    "name": "Bash",
    "description": "Run a shell command.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
WEATHER = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}


def claude_code_body(max_tokens: int = 32000, billing: str = BILLING, **extra) -> dict:
    return {
        "model": "default",
        "max_tokens": max_tokens,
        "stream": True,
        "system": [
            {"type": "text", "text": billing},
            {"type": "text", "text": "You are Claude Code.", "cache_control": CACHE},
            {"type": "text", "text": "Answer briefly.", "cache_control": CACHE},
        ],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": SKILLS}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>cwd: /tmp</system-reminder>\n"},
                    {"type": "text", "text": "Say hi.", "cache_control": CACHE},
                ],
            },
        ],
        "tools": [{**BASH, "cache_control": CACHE}],
        "metadata": {"user_id": "user_0a1b_account__session_9f8e"},
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        **GREEDY,
        **extra,
    }


def _post(server, body: dict, path: str = "/v1/messages?beta=true") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=120)


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_claude_code_first_request(hermes_server):
    """32000 max_tokens on 1,024 positions: Anthropic's words, which Claude Code parses to
    retry with less; the retry streams an answer without thinking blocks."""
    counted = _post(hermes_server, claude_code_body(), "/v1/messages/count_tokens?beta=true")
    assert counted.status_code == 200, counted.text
    n = counted.json()["input_tokens"]
    r = _post(hermes_server, claude_code_body())
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"input length and `max_tokens` exceed context limit: {n} + 32000 > 1024"
            ", decrease input length or `max_tokens` and try again",
        },
    }
    r = _post(hermes_server, claude_code_body(max_tokens=1024 - n))  # exactly fits
    assert r.status_code == 200, r.text
    events = _sse(r.text)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert "thinking" not in starts
    start_usage, final = events[0]["message"]["usage"], events[-2]["usage"]
    assert start_usage["input_tokens"] == n
    assert final["input_tokens"] + final["cache_read_input_tokens"] == n
    assert final["cache_creation_input_tokens"] == 0


def test_prompt_too_long_in_anthropics_words(hermes_server):
    long = "One two three four five six seven eight nine ten. " * 120
    body = claude_code_body(max_tokens=8)
    body["messages"][1]["content"][1]["text"] = long
    n = _post(hermes_server, body, "/v1/messages/count_tokens").json()["input_tokens"]
    assert n > 1024
    r = _post(hermes_server, body)
    assert r.status_code == 400
    assert r.json()["error"] == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {n} tokens > 1024 maximum",
    }


def test_second_request_reads_the_prefix_cache(hermes_server):
    """The attribution line changes every request (cch=...); it is left out, so a second
    request with the same prefix reuses the first one's prompt."""
    ant = anthropic.Anthropic(base_url=hermes_server.url, api_key="unused", max_retries=0)
    body = claude_code_body(max_tokens=4)
    kw = {k: v for k, v in body.items() if k not in ("stream", "temperature")}
    kw["extra_body"] = GREEDY
    first = ant.beta.messages.create(betas=BETAS.split(","), **kw)
    kw["system"] = [{"type": "text", "text": BILLING.replace("0f3e2", "77c1d")}, *kw["system"][1:]]
    second = ant.beta.messages.create(betas=BETAS.split(","), **kw)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.usage.cache_read_input_tokens >= total // 2
    assert second.usage.cache_creation_input_tokens == 0
    assert second.content == first.content
    with ant.beta.messages.stream(betas=BETAS.split(","), **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.cache_read_input_tokens >= total // 2
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == total


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "enabled",
                                      "budget_tokens": 4}])  # fmt: skip
def test_thinking_on_a_model_without_thinking(ant, thinking):
    m = ant.messages.create(
        model="default",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        thinking=thinking,
        extra_body=GREEDY,
    )
    assert [b.type for b in m.content] == ["text"]


def test_a_call_cut_by_max_tokens(ant, hermes_server):
    """A forced call cut after 5 tokens: stop_reason max_tokens and no tool_use block, streamed
    and not; with room the same call is whole."""
    kw = dict(
        model="default",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    whole = ant.messages.create(max_tokens=80, **kw)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    cut = ant.messages.create(max_tokens=5, **kw)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
    assert all(b.type != "tool_use" for b in cut.content)
    assert all("<tool_call>" not in b.text for b in cut.content if b.type == "text")
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY}
    r = _post(hermes_server, {**body, "max_tokens": 5, "stream": True})
    events = _sse(r.text)
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert "tool_use" not in starts
    assert not any(e["delta"].get("type") == "input_json_delta" for e in events
                   if e["type"] == "content_block_delta")  # fmt: skip


def test_system_messages_render_where_they_stand(hermes_server):
    """The Hermes template shows a system turn anywhere: the prompt is the conversation with
    the system prompt first and the skills message where Claude Code put it."""
    tok = hermes_server.service.tokenizer
    assert renders_system_in_place(tok)
    body = claude_code_body(max_tokens=8)
    del body["tools"]
    n = _post(hermes_server, body, "/v1/messages/count_tokens").json()["input_tokens"]
    expected = [
        {"role": "system", "content": "You are Claude Code.\n\nAnswer briefly."},
        {"role": "system", "content": SKILLS},
        {"role": "user", "content": "<system-reminder>cwd: /tmp</system-reminder>\nSay hi."},
    ]
    assert n == len(tok.apply_chat_template(expected))
    assert _post(hermes_server, body).status_code == 200


ONE_SYSTEM = (  # as Qwen3.5 / Mistral: a system message only at the start
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_system_messages_fold_where_the_template_takes_one(tmp_path, live_server):
    path = build_tiny_checkpoint(tmp_path / "one-system", chat_template=ONE_SYSTEM)
    tok = Tokenizer(path)
    assert not renders_system_in_place(tok)
    ask = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
           {"role": "assistant", "content": "c"}, {"role": "system", "content": "d"}]  # fmt: skip
    assert place_system(tok, "s", ask) == [
        {"role": "system", "content": "s\n\nb\n\nd"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "c"},
    ]
    srv = live_server(path)
    body = claude_code_body(max_tokens=8)
    del body["tools"]
    r = _post(srv, body)
    assert r.status_code == 200, r.text
    n = _post(srv, body, "/v1/messages/count_tokens").json()["input_tokens"]
    expected = [
        {"role": "system", "content": f"You are Claude Code.\n\nAnswer briefly.\n\n{SKILLS}"},
        {"role": "user", "content": "<system-reminder>cwd: /tmp</system-reminder>\nSay hi."},
    ]
    assert n == len(tok.apply_chat_template(expected))


BAD = [
    ({"context_management": [1]}, "'context_management' must be an object"),
    ({"context_management": {"edits": "x"}}, "'context_management.edits'"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]},
                   {"role": "user", "content": "x"}]}, "messages[0].content[0].type: "),
    ({"tools": [{"name": "f", "input_schema": 3}]}, "tools[0].input_schema: "),
    ({"top_p": 7}, "top_p"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
      "tools": [BASH]}, "output_config.format: "),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "words"), BAD, ids=[w.split(":")[0] for _, w in BAD])
def test_each_400_names_its_field(hermes_server, extra, words):
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = _post(hermes_server, {**body, **extra})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error


def test_structured_output_config(ant):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    m = ant.messages.create(
        model="default",
        messages=[{"role": "user", "content": "A number?"}],
        max_tokens=40,
        extra_body={
            **GREEDY,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },  # fmt: skip
    )
    assert m.stop_reason == "end_turn"
    assert isinstance(json.loads(m.content[0].text)["n"], int)


def test_tool_search_results_read_as_text_and_image_results_name_their_field(hermes_server):
    """Claude Code's tool search answers with `tool_reference` blocks (the tool itself sent with
    `defer_loading`): they read as text. Its Read tool answers with image blocks: a text-only
    model reads a line saying the image was omitted (refused, every later turn of the
    conversation would be refused too); a bad image is a 400 naming the block."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "grep"}}
    blocks = [{"type": "tool_reference", "tool_name": "Grep"}, {"type": "text", "text": "done"}]
    text = "Tool available: Grep\ndone"

    def body(content) -> dict:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": content}
        return {
            "model": "default",
            "max_tokens": 4,
            "tools": [BASH, {**BASH, "name": "Grep", "defer_loading": True}],
            "messages": [
                {"role": "user", "content": "Find it."},
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{**result, "cache_control": CACHE}]},
            ],
            **GREEDY,
        }

    r = _post(hermes_server, body(blocks))
    assert r.status_code == 200, r.text
    counted = [_post(hermes_server, body(c), "/v1/messages/count_tokens") for c in (blocks, text)]
    assert counted[0].json() == counted[1].json()
    png = base64.b64encode(_png()).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    r = _post(hermes_server, body([*blocks, image]))
    assert r.status_code == 200, r.text
    note = {"type": "text", "text": "[image omitted: this model reads text only]\n"}
    counted = [
        _post(hermes_server, body(c), "/v1/messages/count_tokens")
        for c in ([*blocks, image], [*blocks, note])
    ]
    assert counted[0].json() == counted[1].json()
    bad = {**image, "source": {**image["source"], "data": base64.b64encode(b"not a png").decode()}}
    for path in ("/v1/messages?beta=true", "/v1/messages/count_tokens"):
        r = _post(hermes_server, body([*blocks, bad]), path)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "messages[2].content[0].content[2].source" in error["message"]


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(out, "PNG")
    return out.getvalue()
