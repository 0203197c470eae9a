"""Chat deltas (reasoning, content, tool_calls) as Responses output items and their stream events.

`OutputItems.feed` takes the deltas ChatOutput produces and returns the typed events they
unlock, in OpenAI's order: `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta` / `response.reasoning_text.delta` /
`response.function_call_arguments.delta`, then the `...done` events when the item closes.
The items it holds are the response's `output`, streamed or not.
"""

from __future__ import annotations

import uuid
from typing import Any

from llm_server.tools.output import ChatOutput


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def final_deltas(answer: ChatOutput) -> list[dict[str, Any]]:
    """The whole answer as deltas in output order: reasoning, text, then each call."""
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"reasoning_content": answer.reasoning})
    content = answer.content
    if content and (not answer.called or content.strip()):
        out.append({"content": content})
    if answer.called:
        for i, call in enumerate(answer.calls):
            fn = call["function"]
            head = {"index": i, "id": call["id"], "function": {"name": fn["name"]}}
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return out


class OutputItems:
    """The output items of one response as they are generated."""

    def __init__(self, summary: bool = False) -> None:
        self.summary = summary  # also give the reasoning as summary_text (no summarizer here)
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat delta."""
        if "reasoning_content" in delta:
            return self._text("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._text("message", delta["content"])
        events: list[dict[str, Any]] = []
        for tc in delta.get("tool_calls", ()):
            fn = tc.get("function") or {}
            if tc.get("id") is not None:
                events += self.close()
                item = {
                    "id": new_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "call_id": tc["id"],
                    "name": fn.get("name"),
                    "arguments": "",
                }
                events += self._add(item)
            piece = fn.get("arguments")
            if piece and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += piece
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self._open["id"],
                        "output_index": len(self.items) - 1,
                        "delta": piece,
                    }
                )
        return events

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
        """Close the open item (its `...done` events); `status` "incomplete" when cut short."""
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = status
        index = len(self.items) - 1
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            done = {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}
            events.append({"type": "response.function_call_arguments.done", **done})
        else:
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            part = item["content"][0]
            kind_name = "output_text" if item["type"] == "message" else "reasoning_text"
            text_done = {"type": f"response.{kind_name}.done", **where, "text": part["text"]}
            if item["type"] == "message":
                text_done["logprobs"] = []
            events.append(text_done)
            events.append({"type": "response.content_part.done", **where, "part": dict(part)})
            if item["type"] == "reasoning" and self.summary:
                events += self._summary(item, index)
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        return events

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
