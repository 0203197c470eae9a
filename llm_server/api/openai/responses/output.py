"""Chat deltas (reasoning, content, tool_calls) as Responses output items and their stream events.

`OutputItems.feed` takes the deltas ChatOutput produces and returns the typed events they
unlock, in OpenAI's order: `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` / `response.reasoning_text.delta` /
`response.function_call_arguments.delta`, then the `...done` events when the item closes.
The items it holds are the response's `output`, streamed or not.
"""

from __future__ import annotations

import json
from typing import Any

from llm_server.api.chat.run import new_id
from llm_server.api.openai.responses.tools import ToolMap, chat_name, custom_input, json_object
from llm_server.tools.output import ChatOutput

CALL_ITEMS = ("function_call", "custom_tool_call")


class OutputItems:
    """The output items of one response as they are generated.

    A call becomes a `function_call` item (with `namespace` for a namespaced function) or a
    `custom_tool_call` item (its `input` given whole when the call closes). A call whose
    arguments are not a whole JSON object when it closes (cut off by the token limit) ends
    `incomplete`, never `completed`. Text after a call is held until the answer ends: it is
    shown then, unless the answer's call markup was malformed (that text is the markup)."""

    def __init__(self, summary: bool = False, tools: ToolMap | None = None) -> None:
        self.summary = summary  # also give the reasoning as summary_text (no summarizer here)
        self.tools = tools or ToolMap()
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._args: dict[str, str] = {}  # a custom call's raw arguments by item id
        self._held = ""  # text after a call, until the answer ends
        self._cut = False  # the open call was cut by the token limit (set by finish)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat delta."""
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            if any(i["type"] in CALL_ITEMS for i in self.items):
                self._held += delta["content"]
                return []
            return self._text("message", delta["content"])
        events: list[dict[str, Any]] = []
        for tc in delta.get("tool_calls", ()):
            fn = tc.get("function") or {}
            if tc.get("id") is not None:
                events += self._release() + self.close()
                events += self._add(self._call_item(tc["id"], fn.get("name") or ""))
            piece = fn.get("arguments")
            item = self._open
            if not piece or item is None or item["type"] not in CALL_ITEMS:
                continue
            if item["type"] == "custom_tool_call":
                self._args[item["id"]] += piece
                continue
            item["arguments"] += piece
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            events.append(
                {"type": "response.function_call_arguments.delta", **where, "delta": piece}
            )
        return events

    def _call_item(self, call_id: str, name: str) -> dict[str, Any]:
        target = self.tools.target(name)
        item: dict[str, Any] = {"status": "in_progress", "call_id": call_id, "name": target.name}
        if target.custom:
            item = {"id": new_id("ctc"), "type": "custom_tool_call", **item, "input": ""}
            self._args[item["id"]] = ""
        else:
            item = {"id": new_id("fc"), "type": "function_call", **item, "arguments": ""}
        if target.namespace:
            item["namespace"] = target.namespace
        return item

    def _release(self) -> list[dict[str, Any]]:
        """The held text as a message item (before the next call, or at the end)."""
        held, self._held = self._held, ""
        return self._text("message", held) if held else []

    def finish(self, status: str, answer: ChatOutput) -> list[dict[str, Any]]:
        """The last events: held text (dropped when the call markup was malformed: it is that
        markup), then the open item closed with `status` ("incomplete" at the token limit; a
        call the limit cut, `answer.open_call`, is incomplete whatever its arguments)."""
        if answer.error is not None:
            self._held = ""
        self._cut = answer.open_call
        return self._release() + self.close(status)

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [
            {
                "type": "response.output_item.added",
                "output_index": len(self.items) - 1,
                "item": _shown(item),
            }
        ]

    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != kind:
            events += self.close()
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "status": "in_progress"}
                item |= {"role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
                item["status"] = "in_progress"
                part = {"type": "reasoning_text", "text": ""}
            events += self._add(item)
            events.append({**self._where(), "type": "response.content_part.added", "part": part})
            item["content"].append(dict(part))
        item["content"][0]["text"] += piece
        kind_name = "output_text" if kind == "message" else "reasoning_text"
        event = {**self._where(), "type": f"response.{kind_name}.delta", "delta": piece}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
        }

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item (its `...done` events); `status` "incomplete" when cut short.
        A call is `completed` exactly when its arguments are a whole JSON object."""
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        events: list[dict[str, Any]] = []
        cut, self._cut = self._cut and item["type"] in CALL_ITEMS, False
        if item["type"] == "function_call":
            whole = json_object(item["arguments"]) and not cut
            item["status"] = "completed" if whole else "incomplete"
            done = {"type": "response.function_call_arguments.done", **where}
            events.append(done | {"name": item["name"], "arguments": item["arguments"]})
        elif item["type"] == "custom_tool_call":
            raw = self._args.pop(item["id"])
            item["status"] = "completed" if json_object(raw) and not cut else "incomplete"
            item["input"] = text = custom_input(raw)
            if text:
                events.append(
                    {"type": "response.custom_tool_call_input.delta", **where, "delta": text}
                )
            events.append({"type": "response.custom_tool_call_input.done", **where, "input": text})
        else:
            item["status"] = status
            part = item["content"][0]
            kind_name = "output_text" if item["type"] == "message" else "reasoning_text"
            text_done = {"type": f"response.{kind_name}.done", **where, "content_index": 0}
            text_done["text"] = part["text"]
            if item["type"] == "message":
                text_done["logprobs"] = []
            events.append(text_done)
            events.append(
                {
                    "type": "response.content_part.done",
                    **where,
                    "content_index": 0,
                    "part": dict(part),
                }
            )
            if item["type"] == "reasoning" and self.summary:
                events += self._summary(item, index)
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return events

    def reply(self) -> dict[str, Any]:
        """The answer as the chat assistant message the stored conversation continues from
        (completed calls only: a cut call was never made)."""
        texts = {"message": "", "reasoning": ""}
        calls = []
        for item in self.items:
            if item["type"] in texts:
                texts[item["type"]] += item["content"][0]["text"]
            elif item["status"] == "completed":
                args = item.get("arguments")
                if item["type"] == "custom_tool_call":
                    args = json.dumps({"input": item["input"]}, ensure_ascii=False)
                name = chat_name(item["name"], item.get("namespace"))
                fn = {"name": name, "arguments": args}
                calls.append({"id": item["call_id"], "type": "function", "function": fn})
        reply: dict[str, Any] = {"role": "assistant", "content": texts["message"]}
        if calls:
            reply["content"] = texts["message"] if texts["message"].strip() else ""
            reply["tool_calls"] = calls
        if texts["reasoning"]:
            reply["reasoning_content"] = texts["reasoning"]
        return reply

    def _summary(self, item: dict[str, Any], index: int) -> list[dict[str, Any]]:
        text = item["content"][0]["text"]
        part = {"type": "summary_text", "text": text}
        item["summary"] = [part]
        where = {"item_id": item["id"], "output_index": index, "summary_index": 0}
        empty = {"type": "summary_text", "text": ""}
        return [
            {"type": "response.reasoning_summary_part.added", **where, "part": empty},
            {"type": "response.reasoning_summary_text.delta", **where, "delta": text},
            {"type": "response.reasoning_summary_text.done", **where, "text": text},
            {"type": "response.reasoning_summary_part.done", **where, "part": part},
        ]


def _shown(item: dict[str, Any]) -> dict[str, Any]:
    """A copy of `item` as first announced (content parts arrive by their own events)."""
    out = dict(item)
    if "content" in out:
        out["content"] = []
    return out
