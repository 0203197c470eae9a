"""The agents' recording proxy: a canned tool call answers the first Messages request that
offers the tool, as the official SDK reads it; every other request reaches the server."""

from __future__ import annotations

import json

import anthropic
import openai
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from llm_server.testing.agents_proxy import RecordingProxy, _ServerThread, calls_made

READ = {"name": "Read", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                         "required": ["file_path"]}}  # fmt: skip
UPSTREAM_ANSWER = {
    "id": "msg_up", "type": "message", "role": "assistant", "model": "m",
    "content": [{"type": "text", "text": "from upstream"}], "stop_reason": "end_turn",
    "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2},
}  # fmt: skip


def _upstream() -> _ServerThread:
    async def messages(request):
        return JSONResponse(UPSTREAM_ANSWER)

    server = _ServerThread(
        Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])]), "up"
    )
    server.start()
    return server


def test_the_canned_call_answers_once_then_requests_reach_the_server():
    up = _upstream()
    try:
        with RecordingProxy(up.url, canned_call=("Read", {"file_path": "/w/shot.png"})) as proxy:
            client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
            ask = {"model": "m", "max_tokens": 8, "tools": [READ],
                   "messages": [{"role": "user", "content": "Read shot.png"}]}  # fmt: skip
            with client.messages.stream(**ask) as stream:
                streamed = stream.get_final_message()
            plain = client.messages.create(**ask)
        assert [(b.type, b.name, b.input) for b in streamed.content] == [
            ("tool_use", "Read", {"file_path": "/w/shot.png"})
        ]
        assert streamed.stop_reason == "tool_use"
        assert plain.content[0].text == "from upstream"  # the second request went through
        first, second = proxy.model_calls()
        assert first.forced and not second.forced
        assert calls_made(first) == [("Read", {"file_path": "/w/shot.png"})]
    finally:
        up.stop()


def test_a_request_without_the_tool_is_forwarded():
    up = _upstream()
    try:
        with RecordingProxy(up.url, canned_call=("Read", {"file_path": "a"})) as proxy:
            client = anthropic.Anthropic(base_url=proxy.url, api_key="x", max_retries=0)
            answer = client.messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
        assert answer.content[0].text == "from upstream"
        assert not proxy.model_calls()[0].forced
    finally:
        up.stop()


def test_the_canned_call_answers_a_responses_request_as_the_openai_sdk_reads_it():
    up = _upstream()
    tool = {"type": "function", "name": "view_image", "parameters": {"type": "object"}}
    try:
        with RecordingProxy(up.url, canned_call=("view_image", {"path": "shot.png"})) as proxy:
            client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0)
            with client.responses.stream(model="m", input="Look.", tools=[tool]) as stream:
                streamed = stream.get_final_response()
        call = streamed.output[0]
        assert (call.type, call.name, json.loads(call.arguments)) == (
            "function_call", "view_image", {"path": "shot.png"},
        )  # fmt: skip
        assert calls_made(proxy.model_calls()[0]) == [("view_image", {"path": "shot.png"})]
    finally:
        up.stop()
