"""Tool-call parsers per model family: raw model text -> content and calls, incrementally.

`parse(text, final)` is called with the whole text generated so far; its result only ever grows
(content and each call's arguments gain suffixes), so streaming sends the differences. A marker
that may still be forming at the end of the text is held back. With `final=True` a call that is
malformed sets `error`, and the caller returns the whole text as content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from llm_server.tools.spec import ToolSpec

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object; complete once `complete`
    complete: bool


@dataclass(frozen=True)
class ParseResult:
    content: str  # text outside calls that is safe to show
    calls: tuple[ParsedCall, ...]
    error: str | None = None  # final only: why the call markup is malformed


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def json_end(text: str, start: int) -> int | None:
    """End index of the complete JSON object starting at `start`, or None while incomplete."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    return end if isinstance(value, dict) else None


_NAME_FIRST = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def json_call(body: str, closed: bool) -> ParsedCall | str | None:
    """A `{"name": .., "arguments"|"parameters": {..}}` call; None while nothing is known yet,
    a string (the error) when `closed` and malformed."""
    m = _NAME_FIRST.match(body)
    if m is not None:
        name, start = json.loads(f'"{m.group(1)}"'), m.end()
        end = json_end(body, start)
        if end is None:
            if closed:
                return f"the arguments of {name!r} are not a complete JSON object"
            return ParsedCall(name, body[start:], False)
        if closed and not re.fullmatch(r"\s*\}\s*", body[end:]):
            return f"unexpected text after the arguments of {name!r}"
        return ParsedCall(name, body[start:end], closed)
    if not closed:
        return None
    try:  # other key orders: only whole calls
        obj = json.loads(body)
    except json.JSONDecodeError:
        return "the call is not valid JSON"
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
    if not isinstance(name, str) or not isinstance(args, dict):
        return "a call needs a string 'name' and an object 'arguments'"
    return ParsedCall(name, json.dumps(args, ensure_ascii=False), True)


class ToolParser:
    """Base: calls delimited by `start` ... `end` markers after free text (Hermes layout)."""

    name = ""
    start = ""  # the call-start marker (also the lazy grammar's trigger)
    end = ""

    def __init__(self, tools: Sequence[ToolSpec] = ()) -> None:
        self.tools = {t.name: t for t in tools}

    def parse(self, text: str, final: bool = False) -> ParseResult:
        first = text.find(self.start)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, self.start)
            return ParseResult(text[:keep], ())
        content, calls, pos = text[:first], [], first
        while pos >= 0:
            body_at = pos + len(self.start)
            stop = text.find(self.end, body_at)
            closed = stop >= 0 or final
            body = text[body_at : stop if stop >= 0 else len(text)]
            if stop < 0 and not final:
                body = body[: len(body) - held_back(body, self.end)]
            call = self.parse_body(body, closed)
            if isinstance(call, str):
                return ParseResult(content, tuple(calls), call)
            if call is not None:
                calls.append(call)
            if stop < 0:
                break
            after = stop + len(self.end)
            pos = text.find(self.start, after)
            rest = text[after : pos if pos >= 0 else len(text)]
            if final and pos < 0 and rest.strip():
                content += rest  # text after the last call
        return ParseResult(content, tuple(calls))

    def parse_body(self, body: str, closed: bool) -> ParsedCall | str | None:
        return json_call(body, closed)


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder XML: `<tool_call>\\n<function=f>\\n<parameter=p>\\nv\\n</parameter>\\n</function>`."""

    name = "qwen3_coder"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_body(self, body: str, closed: bool) -> ParsedCall | str | None:
        m = _FUNCTION.match(body)
        if m is None:
            return "a call needs <function=name>" if closed else None
        name, pos, parts = m.group(1).strip(), m.end(), []
        while (p := _PARAM.match(body, pos)) is not None:
            key = p.group(1).strip()
            value = self._value(name, key, p.group(2))
            parts.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            pos = p.end()
        done = re.match(r"\s*</function>\s*$", body[pos:]) is not None
        if closed and not done:
            return f"the call to {name!r} is not well-formed XML"
        args = "{" + ", ".join(parts) + ("}" if done else "")
        return ParsedCall(name, args, done and closed)

    def _value(self, fn: str, key: str, raw: str) -> object:
        tool = self.tools.get(fn)
        schema = (tool.parameters.get("properties") or {}).get(key, {}) if tool else {}
        if schema.get("type") == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole answer is `{"name": .., "parameters": {..}}` (optionally after
    `<|python_tag|>`), several separated by `;`."""

    name = "llama3_json"
    start = "<|python_tag|>"

    def parse(self, text: str, final: bool = False) -> ParseResult:
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            stripped = stripped[len(self.start) :].lstrip()
        elif not stripped.startswith("{"):
            if not final and self.start.startswith(stripped):
                return ParseResult("", ())
            return ParseResult(text, ())
        calls, pos = [], 0
        while True:
            end = json_end(stripped, pos)
            if end is None:  # the last call is still being written
                call = json_call(stripped[pos:], final)
                if isinstance(call, str):
                    return ParseResult("", tuple(calls), call)
                if call is not None:
                    calls.append(call)
                return ParseResult("", tuple(calls))
            call = json_call(stripped[pos:end], True)
            if isinstance(call, str):
                return ParseResult("", tuple(calls), call)
            calls.append(call)
            sep = re.match(r"\s*;?\s*", stripped[end:])
            pos = end + sep.end()
            if pos >= len(stripped):
                return ParseResult("", tuple(calls))
            if not stripped.startswith("{", pos):
                return ParseResult(
                    "", tuple(calls), "unexpected text after a call" if final else None
                )


class MistralParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]` or, from tokenizer v11,
    `[TOOL_CALLS]name[ARGS]{..}` per call."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    end = "[TOOL_CALLS]"  # v11: each call starts with the marker

    def parse(self, text: str, final: bool = False) -> ParseResult:
        first = text.find(self.start)
        if first < 0:
            return super().parse(text, final)
        rest = text[first + len(self.start) :].lstrip()
        if rest.startswith("["):
            return self._array(text[:first], rest, final)
        calls = []
        chunks = text[first:].split(self.start)[1:]
        for i, chunk in enumerate(chunks):
            closed = final or i < len(chunks) - 1
            name, sep, args = chunk.partition("[ARGS]")
            if not sep:
                if closed:
                    return ParseResult(text[:first], tuple(calls), "a call needs [ARGS]")
                break
            end = json_end(args, 0)
            if end is None:
                if closed:
                    return ParseResult(text[:first], tuple(calls), "arguments are not JSON")
                calls.append(ParsedCall(name.strip(), args, False))
                break
            calls.append(ParsedCall(name.strip(), args[:end], closed))
        return ParseResult(text[:first], tuple(calls))

    def _array(self, content: str, rest: str, final: bool) -> ParseResult:
        calls, pos = [], 1
        while True:
            pos += len(rest[pos:]) - len(rest[pos:].lstrip())
            if rest.startswith("]", pos) or (pos >= len(rest) and calls):
                return ParseResult(content, tuple(calls))
            end = json_end(rest, pos)
            if end is None:
                call = json_call(rest[pos:], final)
                if isinstance(call, str):
                    return ParseResult(content, tuple(calls), call)
                if call is not None:
                    calls.append(call)
                return ParseResult(content, tuple(calls))
            call = json_call(rest[pos:end], True)
            if isinstance(call, str):
                return ParseResult(content, tuple(calls), call)
            calls.append(call)
            pos = end + len(rest[end:]) - len(rest[end:].lstrip())
            if rest.startswith(",", pos):
                pos += 1
