"""Assemble one chat answer from the raw generated text: reasoning, content and tool calls.

The route feeds text deltas; `feed` returns the OpenAI stream deltas they unlock (reasoning,
content, `tool_calls` with the id and name first, then argument fragments), and `message` gives
the non-streamed message. Call markup never reaches `content` unless it is malformed, in which
case the whole answer is returned as text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from llm_server.tools.parsers import ParseResult, ToolParser
from llm_server.tools.reasoning import ReasoningSplitter


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Sent:
    reasoning: int = 0
    content: int = 0


class ChatOutput:
    """One choice's output state; `parser`/`splitter` None when not in use."""

    def __init__(
        self,
        parser: ToolParser | None,
        splitter: ReasoningSplitter | None,
        max_calls: int | None = None,
    ) -> None:
        self.parser = parser
        self.splitter = splitter
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls dropped
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # OpenAI tool_calls entries, arguments so far
        self.error: str | None = None
        self.open_call = False  # a token limit cut the answer inside a call (never complete)
        self.reasoning_tokens = 0
        self._sent = _Sent()
        self._thinking_over = splitter is None

    def feed(self, delta: str, tokens: int = 1, final: bool = False) -> list[dict[str, Any]]:
        """Add `delta` (made of `tokens` tokens); the stream deltas now safe to send."""
        self.text += delta
        if self.splitter is not None:
            split = self.splitter.split(self.text, final)
            if split.thinking and not self._thinking_over:  # through the token closing it
                self.reasoning_tokens += tokens
            reasoning, answer, self._thinking_over = split.reasoning, split.answer, split.ended
        else:
            reasoning, answer = "", self.text
        parsed = self.parser.parse(answer, final) if self.parser else ParseResult(answer, ())
        if parsed.error is not None:  # malformed: the whole answer is text
            self.error = parsed.error
            parsed = ParseResult(answer, ())
        return self._diff(reasoning, parsed)

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """The last deltas once generation ended (held-back text, a malformed call as text).

        `cut`: a token limit ended it. A call it cut stays a call with the arguments so far
        (`open_call`, never `called`) and its markup stays out of the content."""
        if not cut or self.parser is None:
            return self.feed("", tokens=0, final=True)
        out = self.feed("", tokens=0)
        closed = self.parser.parse(self._answer(final=True), final=True)
        self.open_call = closed.error is not None or any(
            not c.complete for c in closed.calls[: self.max_calls]
        )
        return out

    def _diff(self, reasoning: str, parsed: ParseResult) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if len(reasoning) > self._sent.reasoning:
            piece = reasoning[self._sent.reasoning :]
            out.append({"reasoning_content": piece, "reasoning": piece})
        self.reasoning, self._sent.reasoning = reasoning, max(self._sent.reasoning, len(reasoning))
        if len(parsed.content) > self._sent.content:
            out.append({"content": parsed.content[self._sent.content :]})
            self._sent.content = len(parsed.content)
        self.content = parsed.content
        for i, call in enumerate(parsed.calls[: self.max_calls]):
            if i == len(self.calls):
                entry = {"id": call_id(), "type": "function"}
                entry["function"] = {"name": call.name, "arguments": ""}
                self.calls.append(entry)
                out.append(
                    {"tool_calls": [{"index": i, **entry, "function": dict(entry["function"])}]}
                )
            fn = self.calls[i]["function"]
            if len(call.arguments) > len(fn["arguments"]):
                piece = call.arguments[len(fn["arguments"]) :]
                fn["arguments"] = call.arguments
                out.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        return out

    @property
    def plain(self) -> bool:
        """True when nothing is parsed: the text is all content."""
        return self.parser is None and self.splitter is None

    def _answer(self, final: bool) -> str:
        """The answer part of the text (after any thinking)."""
        return self.splitter.split(self.text, final).answer if self.splitter else self.text

    @property
    def called(self) -> bool:
        """True when the answer is well-formed, complete tool calls (finish_reason tool_calls)."""
        return bool(self.calls) and self.error is None and not self.open_call

    def message(self) -> dict[str, Any]:
        """The non-streamed `message` (after `finish`); a call a limit cut is shown as far as
        it got, as the stream showed it (finish_reason `length` says it is not complete)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.called or (self.open_call and self.calls):
            msg["content"] = self.content if self.content.strip() else None
            msg["tool_calls"] = self.calls
        if self.splitter is not None:
            msg["reasoning_content"] = self.reasoning or None
            msg["reasoning"] = self.reasoning or None
        return msg

    def finish_reason(self, base: str) -> str:
        return "tool_calls" if self.called else base
