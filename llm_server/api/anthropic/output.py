"""Chat deltas as Anthropic content blocks and their stream events.

`ContentBlocks.feed` turns the deltas ChatOutput produces into `content_block_start` /
`content_block_delta` (`thinking_delta`, `text_delta`) / `content_block_stop` events, and
`finish` the whole calls into `tool_use` blocks (one `input_json_delta` each); the blocks it
holds are the message's `content`.
"""

from __future__ import annotations

import json
from typing import Any


def tool_use_id(call_id: str) -> str:
    """Anthropic-style id for a call id (`call_<hex>` -> `toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as its `input`, or None when they are no whole JSON object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


class ContentBlocks:
    """The content blocks of one message as they are generated.

    Text and thinking stream as they come; a `tool_use` block is held until the answer ends and
    goes out whole only when the call is (`finish`): a call cut by `max_tokens` or left
    unparsable is dropped (`dropped`), never presented as a complete call with broken input."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # "thinking" | "text"
        self._calls: list[dict[str, Any]] = []  # held calls: id, name, the input's JSON so far
        self.dropped = False  # a held call was not whole

    @property
    def tool_uses(self) -> int:
        return sum(b["type"] == "tool_use" for b in self.blocks)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """Events for one chat delta."""
        if "reasoning_content" in delta:
            return self._text("thinking", delta["reasoning_content"])
        if "content" in delta:
            return self._text("text", delta["content"])
        for tc in delta.get("tool_calls", ()):
            fn = tc.get("function") or {}
            if tc.get("id") is not None:
                self._calls.append({"id": tc["id"], "name": fn.get("name"), "json": ""})
            if fn.get("arguments") and self._calls:
                self._calls[-1]["json"] += fn["arguments"]
        return []

    def finish(self, called: bool) -> list[dict[str, Any]]:
        """Close the open block, then the held calls as whole `tool_use` blocks when the
        answer ended as well-formed calls (`called`) and each input is a JSON object."""
        events = self.close()
        for call in self._calls:
            value = _input(call["json"]) if called else None
            if value is None:
                self.dropped = True
                continue
            block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["name"]}
            events += self._start({**block, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": call["json"]}))
            self.blocks[-1]["input"] = value
            events += self.close()
        self._calls = []
        return events

    def _text(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open != kind:
            block = {"type": "text", "text": ""}
            if kind == "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._start(block)
        self.blocks[-1][kind] += piece
        name = "text_delta" if kind == "text" else "thinking_delta"
        events.append(self._delta({"type": name, kind: piece}))
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self._open = block["type"]
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        return events + [{**start, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def close(self) -> list[dict[str, Any]]:
        """Close the open block (`content_block_stop`)."""
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]
