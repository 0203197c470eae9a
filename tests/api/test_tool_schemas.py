"""A tool's schema is checked against the JSON Schema meta-schema at the request boundary.

A schema that is not a JSON Schema is refused with a 400 naming its field, on each API in that
API's error shape; the schemas real agents send (recorded Claude Code and Codex requests, and
opencode- and Qwen Code-shaped ones: draft-07 `$schema`, extra keywords, ECMA-262 patterns)
pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_server.api.anthropic import fields as anthropic_fields
from llm_server.api.openai.responses.tools import chat_tools as responses_tools
from llm_server.api.shared.errors import APIError
from llm_server.api.shared.tool_fields import parse_tools

AGENTS = Path(__file__).parents[1] / "data" / "agents"
BAD = {"type": "object", "properties": {"city": {"type": 12}}, "required": "city"}
TYPES = "['array', 'boolean', 'integer', 'null', 'number', 'object', 'string']"
MESSAGE = (
    "the schema of tool 'get_weather' is not a valid JSON Schema (Draft 2020-12): "
    f"at 'properties.city.type': 12 is not one of {TYPES}; "
    "at 'required': 'city' is not of type 'array'"
)
WHERE = "properties.city.type"


def _chat_tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}


def _refusal(parameters: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_tools({"tools": [_chat_tool(parameters)]})
    return caught.value


# -- over HTTP: each API's field and error body -----------------------------------------------


def test_chat_completions_refuses_a_schema_that_is_not_one(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body | {"tools": [_chat_tool(BAD)]})
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": MESSAGE,
            "type": "invalid_request_error",
            "param": f"tools[0].function.parameters.{WHERE}",
            "code": "invalid_value",
        }
    }


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_refuses_in_anthropics_shape(http, path):
    tool = {"name": "get_weather", "description": "Weather", "input_schema": BAD}
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = http.post(path, json=body | {"tools": [tool]})
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"tools[0].input_schema.{WHERE}: {MESSAGE}",
        },
    }


def test_responses_refuses_naming_its_field(http):
    tool = {"type": "function", "name": "get_weather", "parameters": BAD}
    body = {"model": "default", "input": "hi", "max_output_tokens": 2, "tools": [tool]}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": MESSAGE,
            "type": "invalid_request_error",
            "param": f"tools[0].parameters.{WHERE}",
            "code": "invalid_value",
        }
    }
    ns = {"type": "namespace", "name": "ns", "description": "d", "tools": [tool]}
    r = http.post("/v1/responses", json=body | {"tools": [ns]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == f"tools[0].tools[0].parameters.{WHERE}"


def test_a_valid_schema_is_answered(http):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body | {"tools": [_chat_tool(schema)]})
    assert r.status_code == 200, r.text


# -- the check itself -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "param", "message"),
    [
        ({"type": "strin"}, "type", f"(Draft 2020-12): at 'type': 'strin' is not one of {TYPES}"),
        ({"type": ["string", 3]}, "type.1", f"at 'type.1': 3 is not one of {TYPES}"),
        ({"properties": []}, "properties", "at 'properties': [] is not of type 'object'"),
        ({"required": ["a", "a"]}, "required", "at 'required': ['a', 'a'] has non-unique elements"),
        ({"minLength": -1}, "minLength", "at 'minLength': -1 is less than the minimum of 0"),
        (
            {"anyOf": [{"type": "string"}, {"minimum": "a"}]},
            "anyOf.1.minimum",
            "at 'anyOf.1.minimum': 'a' is not of type 'number'",
        ),
        (  # the draft `$schema` names: draft-07's array form of `items`, its entry checked
            {"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "x"}]},
            "items.0.type",
            f"(Draft 7): at 'items.0.type': 'x' is not one of {TYPES}",
        ),
    ],
)
def test_the_first_bad_keyword_is_named(parameters, param, message):
    err = _refusal(parameters)
    assert (err.status, err.code) == (400, "invalid_value")
    assert err.param == f"tools[0].function.parameters.{param}"
    assert err.message.startswith("the schema of tool 'get_weather' is not a valid JSON Schema (")
    assert err.message.endswith(message)


def test_draft_2020_12_items_is_a_schema_not_a_list():
    err = _refusal({"items": [{"type": "string"}]})
    assert err.param == "tools[0].function.parameters.items"
    assert "(Draft 2020-12)" in err.message


OPENCODE_READ = {  # zod-to-json-schema's output, as opencode sends it
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "filePath": {"type": "string", "description": "The path to the file to read"},
        "offset": {"type": "number", "description": "The line number to start reading from"},
        "limit": {"type": "number", "exclusiveMinimum": 0},
    },
    "required": ["filePath"],
    "additionalProperties": False,
}
QWEN_CODE_GLOB = {  # Gemini CLI's declarations: no `$schema`, extra annotations
    "type": "object",
    "properties": {
        "pattern": {"type": "string", "description": "The glob pattern", "minLength": 1},
        "path": {"type": ["string", "null"], "pattern": "^[\\p{L}/._-]+$"},  # ECMA-262 only
        "case_sensitive": {"type": "boolean", "default": False, "examples": [True]},
    },
    "required": ["pattern"],
    "x-tool-kind": "search",
    "title": "glob",
}


@pytest.mark.parametrize("schema", [OPENCODE_READ, QWEN_CODE_GLOB], ids=["opencode", "qwen"])
def test_agent_shaped_schemas_pass(schema):
    assert parse_tools({"tools": [_chat_tool(schema)]}).tools[0].parameters == schema


def test_recorded_agent_tools_pass():
    claude = json.loads((AGENTS / "claude_code_2.1.332_first_request.json").read_text())
    tools = parse_tools({"tools": anthropic_fields.chat_tools(claude["body"]["tools"])}).tools
    assert len(tools) == len(claude["body"]["tools"]) == 12
    assert any("$schema" in t.parameters for t in tools)
    codex = json.loads((AGENTS / "codex_0.171.0_first_request.json").read_text())
    chat, _ = responses_tools(codex["body"]["tools"])
    assert len(parse_tools({"tools": chat}).tools) == len(chat) > 0
