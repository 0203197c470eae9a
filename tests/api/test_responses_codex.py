"""/v1/responses as Codex CLI speaks it: its first request's shape, namespaced and custom tools,
hosted tools left out, no max_output_tokens, and a call cut by the token limit (issue 34).

The body below has the keys and item shapes Codex 0.171.0 sends (recorded from the real CLI):
developer messages with ids, function tools with `strict: false`, its `multi_agent_v1`
namespace, a free-form `apply_patch` custom tool, `web_search`, `include`, `store: false`,
`prompt_cache_key`, `client_metadata`, `reasoning: {"summary": "auto"}`, no
`max_output_tokens`. Forced tool choices run decoding under the call grammar, so the tiny
random model's calls are valid by construction.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from llm_server.api.openai.responses.input import parse_responses
from llm_server.api.openai.responses.tools import ToolMap, chat_tools, custom_input
from llm_server.testing.tiny import HERMES_TEMPLATE, TinySpec, build_tiny_checkpoint
from tests.api.helpers import WEATHER_SCHEMA

CONTEXT = 2048  # Codex-shaped tools take ~1,200 of the tiny tokenizer's tokens
RECORDED = Path(__file__).parents[1] / "data" / "agents" / "codex_0.171.0_first_request.json"

EXEC = {
    "type": "object",
    "properties": {"cmd": {"type": "string", "maxLength": 20}},
    "required": ["cmd"],
    "additionalProperties": False,
}
SPAWN = {
    "type": "object",
    "properties": {"message": {"type": "string", "maxLength": 16}},
    "required": ["message"],
    "additionalProperties": False,
}
LARK = 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'
NS_DESC = "Tools for spawning and managing sub-agents."
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Run a command.",
     "strict": False, "parameters": EXEC},
    {"type": "namespace", "name": "multi_agent_v1", "description": NS_DESC, "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn an agent.",
         "strict": False, "parameters": SPAWN},
        {"type": "function", "name": "close_agent", "description": "Close an agent.",
         "strict": False, "parameters": SPAWN}]},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": LARK}},
    {"type": "web_search", "external_web_access": False},
]  # fmt: skip
ASK = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}
CODEX_INPUT = [
    {"type": "message", "id": "msg_1", "role": "developer",
     "content": [{"type": "input_text", "text": "You are a coding agent."}]},
    {"type": "message", "id": "msg_2", "role": "user",
     "content": [{"type": "input_text", "text": "<environment_context>/w</environment_context>"}]},
    {**ASK, "id": "msg_3"},
]  # fmt: skip


@pytest.fixture(scope="module")
def codex_server(tmp_path_factory):
    """The tiny Hermes-template model with CONTEXT positions (4 concurrent rows)."""
    from llm_server.testing.live import serving

    spec = TinySpec(max_position_embeddings=CONTEXT)
    path = tmp_path_factory.mktemp("codex") / "tiny-codex"
    with serving(build_tiny_checkpoint(path, spec, HERMES_TEMPLATE), concurrent=4) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(codex_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=codex_server.url + "/v1", api_key="unused", max_retries=0)


def codex_body(**over) -> dict:
    """A request with the fields and shapes of Codex's first request."""
    body = {
        "model": "default",
        "input": CODEX_INPUT,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a23790-5aa6-7c63-9648-1203c5e8f623",
        "client_metadata": {"turn_id": "01a23790-5abd", "x-codex-turn-metadata": "{}"},
    }
    return body | over


def events_of(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def stream(url: str, body: dict) -> tuple[httpx.Response, list[dict]]:
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r, []
        return r, events_of(r)


def test_codex_first_request(codex_server):
    """Accepted whole; web_search left out and said so; no 512-token default: greedy, the
    random model runs to the end of the context (CONTEXT positions)."""
    r, events = stream(codex_server.url, codex_body(temperature=0))
    assert r.status_code == 200
    assert r.headers["x-llm-server-dropped-tools"] == "web_search"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" == f"response.{final['status']}"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["max_output_tokens"] is None and final["store"] is False
    usage = final["usage"]
    # the last sampled token needs no position of its own
    assert usage["input_tokens"] + usage["output_tokens"] == CONTEXT + 1
    assert usage["output_tokens"] > 512
    assert final["tools"] == CODEX_TOOLS  # echoed as sent
    gone = httpx.get(f"{codex_server.url}/v1/responses/{final['id']}", timeout=30)
    assert gone.status_code == 404  # store: false


def test_codex_tools_reach_the_prompt(codex_server, oai):
    """The prompt is the chat prompt with the namespace's functions as `<ns>__<name>` (its
    description first), the custom tool as one string `input` with its grammar shown, and
    nothing for web_search."""
    body = codex_body(stream=False, max_output_tokens=1, temperature=0)
    body |= {"reasoning": {"effort": "xhigh", "summary": "auto"}, "service_tier": "priority"}
    r = httpx.post(codex_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    custom = {"type": "object", "properties": {"input": {"type": "string", "description":
              "the tool's input, as text"}}, "required": ["input"], "additionalProperties": False}  # fmt: skip
    tools = [
        ("exec_command", "Run a command.", EXEC, False),
        ("multi_agent_v1__spawn_agent", f"{NS_DESC}\nSpawn an agent.", SPAWN, False),
        ("multi_agent_v1__close_agent", f"{NS_DESC}\nClose an agent.", SPAWN, False),
        ("apply_patch", f"Edit files.\n\nThe input follows this lark grammar:\n{LARK}", custom,
         False),
    ]  # fmt: skip
    chat = oai.chat.completions.create(
        model="default",
        messages=[
            {"role": "developer", "content": "You are a coding agent."},
            {"role": "user", "content": "<environment_context>/w</environment_context>"},
            {"role": "user", "content": "say hi"},
        ],
        tools=[
            {
                "type": "function",
                "function": {"name": n, "description": d, "parameters": p, "strict": s},
            }
            for n, d, p, s in tools
        ],  # fmt: skip
        max_tokens=1,
        temperature=0,
    )
    assert r.json()["usage"]["input_tokens"] == chat.usage.prompt_tokens


def test_namespaced_call_round_trip(codex_server, oai):
    kw = dict(
        model="default",
        input=[ASK],
        tools=CODEX_TOOLS,
        tool_choice={"type": "function", "name": "spawn_agent"},  # unique: its namespace found
        max_output_tokens=80,
        temperature=0,
    )
    first = oai.responses.create(**kw)
    (call,) = first.output
    assert (call.type, call.name, call.namespace) == (
        "function_call",
        "spawn_agent",
        "multi_agent_v1",
    )
    assert call.status == "completed" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SPAWN)
    with oai.responses.stream(**kw) as s:
        events = list(s)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(d.name, d.namespace, d.arguments) for d in done] == [
        ("spawn_agent", "multi_agent_v1", call.arguments)
    ]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "agent a1"}
    again = dict(tools=CODEX_TOOLS, tool_choice="none", max_output_tokens=4, temperature=0)
    sent = oai.responses.create(
        model="default", input=[ASK, call.model_dump(exclude_none=True), result], **again
    )
    chained = oai.responses.create(
        model="default", previous_response_id=first.id, input=[result], **again
    )
    assert sent.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens
    assert sent.output_text == chained.output_text


def test_custom_tool_round_trip(codex_server, oai):
    kw = dict(
        model="default",
        input=[ASK],
        tools=CODEX_TOOLS,
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=80,
        temperature=0,
    )
    first = oai.responses.create(**kw)
    (call,) = first.output
    assert (call.type, call.name, call.status) == ("custom_tool_call", "apply_patch", "completed")
    assert isinstance(call.input, str) and call.namespace is None
    with oai.responses.stream(**kw) as s:
        events = list(s)
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done.input == call.input
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == call.input
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "patched"}
    again = dict(tools=CODEX_TOOLS, tool_choice="none", max_output_tokens=4, temperature=0)
    sent = oai.responses.create(
        model="default", input=[ASK, call.model_dump(exclude_none=True), result], **again
    )
    chained = oai.responses.create(
        model="default", previous_response_id=first.id, input=[result], **again
    )
    assert sent.usage.input_tokens == chained.usage.input_tokens > first.usage.input_tokens


FN_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA, "strict": True}


def test_cut_call_is_incomplete_and_accepted_back(codex_server, oai):
    """A forced call cut by max_output_tokens inside its arguments: the response is incomplete
    and its call item too (never a completed call with unfinished arguments), streamed and
    not; sent back verbatim, as Codex sends everything back, the items are accepted (the cut
    call is not shown to the model)."""
    kw = dict(
        model="default",
        input=[ASK],
        tools=[FN_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    whole = oai.responses.create(**kw, max_output_tokens=80)
    assert whole.status == "completed"
    full = whole.output[0].arguments
    for cut_at in range(whole.usage.output_tokens - 1, 0, -1):  # the last limit inside them
        cut = oai.responses.create(**kw, max_output_tokens=cut_at)
        if cut.output[0].arguments != full:
            break
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    (call,) = cut.output
    assert call.type == "function_call" and call.status == "incomplete"
    assert full.startswith(call.arguments) and call.arguments
    with oai.responses.stream(**kw, max_output_tokens=cut_at) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.status for d in done] == ["incomplete"] and done[0].arguments == call.arguments
    assert events[-1].response.output == done
    go_on = {"type": "message", "role": "user", "content": "go on"}
    again = dict(tools=[FN_TOOL], max_output_tokens=2, temperature=0)
    sent = oai.responses.create(
        model="default", input=[ASK, call.model_dump(exclude_none=True), go_on], **again
    )
    plain = oai.responses.create(model="default", input=[ASK, go_on], **again)
    chained = oai.responses.create(
        model="default", previous_response_id=cut.id, input=[go_on], **again
    )
    answered = {"type": "function_call_output", "call_id": call.call_id, "output": "no JSON"}
    chained_answer = oai.responses.create(
        model="default", previous_response_id=cut.id, input=[answered, go_on], **again
    )
    assert sent.usage.input_tokens == plain.usage.input_tokens == chained.usage.input_tokens
    assert chained_answer.usage.input_tokens == plain.usage.input_tokens


def test_codex_cut_call_with_its_output_is_accepted(codex_server):
    """Codex answers even a cut call (with its parse error) and resends both: 200, and the
    prompt is the one without them."""
    cut = {"type": "function_call", "status": "incomplete", "id": "fc_1", "call_id": "call_1",
           "name": "exec_command", "arguments": '{"cmd":"ec'}  # fmt: skip
    out = {"type": "function_call_output", "call_id": "call_1", "output": "failed to parse"}
    base = codex_body(stream=False, max_output_tokens=1, temperature=0)
    url = codex_server.url + "/v1/responses"
    with_cut = httpx.post(url, json=base | {"input": [*CODEX_INPUT, cut, out]}, timeout=60)
    without = httpx.post(url, json=base, timeout=60)
    assert with_cut.status_code == 200, with_cut.text
    assert with_cut.json()["usage"]["input_tokens"] == without.json()["usage"]["input_tokens"]


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "wizard"}], "tools[0].type"),
        ([{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}],
         "tools[0].tools[0].type"),
        ([CODEX_TOOLS[0], {"type": "namespace", "name": "ns", "description": "d",
          "tools": [{"type": "function", "name": "bad name"}]}], "tools[1].tools[0].name"),
        ([{"type": "custom", "name": "p", "format": {"type": "regexp"}}], "tools[0].format.type"),
    ],
)  # fmt: skip
def test_bad_tools_name_the_field(codex_server, tools, param):
    body = {"model": "default", "input": "hi", "tools": tools, "max_output_tokens": 2}
    r = httpx.post(codex_server.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_custom_input_and_field_names():
    """A custom call's input is the string the model wrote, also when cut inside it; errors
    about a flattened tool name its Responses field."""
    assert custom_input('{"input": "*** Begin Patch"}') == "*** Begin Patch"
    assert custom_input('{"input": "*** Beg') == "*** Beg"
    assert custom_input('{"input": "x"') == "x"
    assert custom_input('{"inp') == "" and custom_input("") == ""
    assert custom_input('{"patch": "x"}') == '{"patch": "x"}'
    tools, tmap = chat_tools(CODEX_TOOLS)
    assert [t["function"]["name"] for t in tools] == [
        "exec_command",
        "multi_agent_v1__spawn_agent",
        "multi_agent_v1__close_agent",
        "apply_patch",
    ]
    assert tmap.dropped == ["web_search"]
    assert tmap.param("tools[2].function.parameters") == "tools[1].tools[1].parameters"
    assert tmap.param("tools[3].function.name") == "tools[2].name"
    assert ToolMap().param("tools[0].function.name") == "tools[0].function.name"


def test_recorded_codex_request_is_accepted_whole(codex_server):
    """Codex 0.171.0's first request as recorded (tests/data/agents): every field and tool is
    accepted; its ~9,900-token prompt is over this model's context, which is the one 400 (the
    error code Codex turns into its own "ran out of room" message), before any stream byte."""
    body = json.loads(RECORDED.read_text())["body"] | {"model": "default"}
    req = parse_responses(body, codex_server.service)
    names = [t.name for t in req.chat.tools.tools]
    assert "exec_command" in names and "multi_agent_v1__spawn_agent" in names
    assert req.tools.target("multi_agent_v1__wait_agent").namespace == "multi_agent_v1"
    assert req.tools.dropped == ["web_search"] and req.store is False
    assert req.chat.params.max_tokens == CONTEXT and req.echo["max_output_tokens"] is None
    assert [m["role"] for m in req.chat.messages] == ["system", "system", "user", "user"]
    r, _ = stream(codex_server.url, body)
    error = r.json()["error"] if r.status_code == 400 else r.read()
    assert (r.status_code, error["code"], error["param"]) == (
        400,
        "context_length_exceeded",
        "input",
    )
