"""Responses output items from chat deltas, without a model: the cases the tiny random model
cannot be made to write on demand (text after a call, malformed markup, a cut custom call)."""

from __future__ import annotations

from types import SimpleNamespace

from llm_server.api.openai.responses.items import input_messages
from llm_server.api.openai.responses.output import OutputItems
from llm_server.api.openai.responses.tools import chat_tools

TOOLS = [
    {"type": "namespace", "name": "ns", "description": "d", "tools": [
        {"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
    {"type": "custom", "name": "apply_patch"},
]  # fmt: skip


def _run(deltas: list[dict], error: str | None = None, open_call: bool = False, status="completed"):
    _, tmap = chat_tools(TOOLS)
    items = OutputItems(tools=tmap)
    events = [e for d in deltas for e in items.feed(d)]
    events += items.finish(status, SimpleNamespace(error=error, open_call=open_call))
    return items, events


def _call(name: str, *pieces: str) -> list[dict]:
    head = {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": name}}]}
    return [head] + [{"tool_calls": [{"index": 0, "function": {"arguments": p}}]} for p in pieces]


def test_text_after_a_call_comes_after_it():
    items, _ = _run([{"content": "Hi. "}, *_call("ns__spawn", '{"a":', " 1}"), {"content": "done"}])
    kinds = [(i["type"], i["status"]) for i in items.items]
    assert kinds == [
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "completed"),
    ]
    call = items.items[1]
    assert (call["name"], call["namespace"], call["arguments"]) == ("spawn", "ns", '{"a": 1}')
    assert items.items[2]["content"][0]["text"] == "done"


def test_malformed_markup_never_becomes_text_after_a_call():
    items, _ = _run([*_call("ns__spawn", '{"a": tru'), {"content": "<tool_call>{...}"}], "bad")
    assert [(i["type"], i["status"]) for i in items.items] == [("function_call", "incomplete")]


def test_a_cut_call_is_incomplete_even_with_whole_arguments():
    items, events = _run(_call("ns__spawn", '{"a": 1}'), open_call=True, status="incomplete")
    (call,) = items.items
    assert call["status"] == "incomplete"
    assert events[-1] == {"type": "response.output_item.done", "output_index": 0, "item": call}


def test_custom_call_input_whole_and_cut():
    items, events = _run(_call("apply_patch", '{"input": "*** Begin', ' Patch"}'))
    (call,) = items.items
    assert (call["type"], call["input"], call["status"]) == (
        "custom_tool_call",
        "*** Begin Patch",
        "completed",
    )
    types = [e["type"] for e in events]
    assert types[-3:] == [
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    items, _ = _run(_call("apply_patch", '{"input": "*** Be'), open_call=True, status="incomplete")
    assert (items.items[0]["input"], items.items[0]["status"]) == ("*** Be", "incomplete")
    reply = OutputItems().reply()
    assert reply == {"role": "assistant", "content": ""}


def test_items_back_as_chat_messages():
    """What the server returned, sent back: namespaced and custom calls under the names the
    model sees; an incomplete call and its output left out."""
    raw = [
        {"type": "message", "role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "ns",
         "arguments": '{"a": 1}', "status": "completed", "id": "fc_1"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "p"},
        {"type": "function_call", "call_id": "c3", "name": "spawn", "namespace": "ns",
         "arguments": '{"a": ', "status": "incomplete"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "patched"},
        {"type": "function_call_output", "call_id": "c3", "output": "bad JSON"},
    ]  # fmt: skip
    out, _ = input_messages(raw, set())
    calls = [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in out[1]["tool_calls"]
    ]
    assert calls == [("c1", "ns__spawn", '{"a": 1}'), ("c2", "apply_patch", '{"input": "p"}')]
    assert [(m["role"], m.get("tool_call_id")) for m in out] == [
        ("user", None),
        ("assistant", None),
        ("tool", "c1"),
        ("tool", "c2"),
    ]
