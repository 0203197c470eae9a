"""The agent APIs' bad-input catalogue: each answers bad input in its own error format."""

from __future__ import annotations

import pytest

from tests.api.helpers import assert_openai_error
from tests.reliability.bad_input import MESS, MSG, RESP, Case, mess, post

TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}


AGENT_CASES = [
    Case("responses-unknown-item-type", RESP, {"input": [{"type": "web_search_call"}]}, 400,
         "input[0].type", ("web_search_call",)),
    Case("responses-image-part", RESP, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0].image_url",
         ("data: URL",)),
    Case("responses-output-without-call", RESP, {"input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, 400,
         "input[0].call_id", ("call_9",)),
    Case("responses-call-arguments-not-json", RESP, {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400,
         "input[0].arguments"),
    Case("responses-unknown-previous-id", RESP, {"input": "hi", "previous_response_id": "resp_x"},
         404, "previous_response_id", ("resp_x",), "not_found"),
    Case("responses-no-input", RESP, {"instructions": "x"}, 400, "input"),
    Case("responses-unknown-tool-type", RESP, {"input": "hi", "tools": [{"type": "wizard"}]}, 400,
         "tools[0].type", ("wizard",)),
    Case("responses-namespace-without-tools", RESP, {"input": "hi", "tools": [
        {"type": "namespace", "name": "ns", "tools": []}]}, 400, "tools[0].tools"),
    Case("responses-custom-call-input-not-text", RESP, {"input": [{"type": "custom_tool_call",
         "call_id": "c", "name": "p", "input": 5}]}, 400, "input[0].input"),
    Case("responses-bad-max-output", RESP, {"input": "hi", "max_output_tokens": 0}, 400,
         "max_output_tokens"),
    Case("responses-background", RESP, {"input": "hi", "background": True}, 400, "background"),
    Case("responses-bad-format", RESP, {"input": "hi", "text": {"format": {"type": "xml"}}}, 400,
         "text.format.type"),
    Case("messages-no-max-tokens", MESS, {"messages": MSG}, 400, None, ("max_tokens",)),
    Case("messages-tool-result-without-use", MESS, mess(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]), 400, None,
         ("toolu_9",)),
    Case("messages-tool-result-for-older-use", MESS, mess(messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]),
         400, None, ("toolu_1",)),
    Case("messages-image-block", MESS, mess(messages=[{"role": "user", "content": [
        {"type": "image", "source": {}}]}]), 400, None, ("image",)),
    Case("messages-bad-role", MESS, mess(messages=[{"role": "wizard", "content": "x"}]), 400,
         None, ("messages[0].role",)),
    Case("messages-prefill", MESS, mess(messages=[*MSG, {"role": "assistant", "content": "a"}]),
         400, None, ("prefill",)),
    Case("messages-temperature-over-1", MESS, mess(temperature=1.5), 400, None, ("temperature",)),
    Case("messages-server-tool", MESS, mess(tools=[{"type": "web_search_20250305",
         "name": "w"}]), 400, None, ("web_search_20250305",)),
    Case("messages-thinking-bad-type", MESS, mess(thinking={"type": "deep"}), 400, None,
         ("thinking.type",)),
    Case("messages-wrong-model", MESS, mess(model="claude-x"), 404, None, ("claude-x",)),
    Case("messages-not-json", MESS, b"{", 400, None, ("not valid JSON",)),
    Case("messages-tool-choice-a-string", MESS, mess(tool_choice="auto"), 400, None,
         ("tool_choice",)),
    Case("messages-tool-choice-unknown-tool", MESS, mess(tools=[{"name": "f", "input_schema":
         {"type": "object"}}], tool_choice={"type": "tool", "name": "g"}), 400, None, ("'g'",)),
    Case("messages-system-image", MESS, mess(system=[{"type": "image"}]), 400, None, ("image",)),
    Case("messages-budget-not-below-max", MESS, mess(thinking={"type": "enabled",
         "budget_tokens": 2}), 400, None, ("thinking.budget_tokens", "below max_tokens")),
    Case("responses-store-a-string", RESP, {"input": "hi", "store": "yes"}, 400, "store"),
    Case("responses-metadata-a-list", RESP, {"input": "hi", "metadata": [1]}, 400, "metadata"),
    Case("responses-include-unknown", RESP, {"input": "hi", "include": ["file_search_call.results"]},
         400, "include"),
    Case("responses-truncation-auto", RESP, {"input": "hi", "truncation": "auto"}, 400,
         "truncation"),
    Case("responses-tool-choice-hosted", RESP, {"input": "hi", "tool_choice": {"type": "web_search"}},
         400, "tool_choice"),
    Case("responses-strict-schema-bad", RESP, {"input": "hi", "text": {"format": {
         "type": "json_schema", "name": "x", "schema": {"type": "wizard"}}}}, 400, "text.format",
         ("wizard",)),
    Case("count-tokens-bad-messages", MESS + "/count_tokens", {"messages": "x"}, 400, None,
         ("messages",)),
]  # fmt: skip


@pytest.mark.parametrize("case", AGENT_CASES, ids=[c.name for c in AGENT_CASES])
def test_bad_agent_input(http, case: Case):
    """/v1/responses answers in OpenAI's error body, /v1/messages in Anthropic's."""
    resp = post(http, case)
    assert "Traceback" not in resp.text and ".py" not in resp.text
    if case.path == RESP:
        err = assert_openai_error(resp, case.status, case.param)
        if case.code is not None:
            assert err["code"] == case.code
        message = err["message"]
    else:
        assert resp.status_code == case.status, resp.text
        body = resp.json()
        assert set(body) == {"type", "error"} and body["type"] == "error"
        kind = {404: "not_found_error"}.get(case.status, "invalid_request_error")
        assert body["error"] == {"type": kind, "message": body["error"]["message"]}
        message = body["error"]["message"]
    for word in case.words:
        assert word in message, (word, message)
