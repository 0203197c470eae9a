"""gpt-oss harmony output: `<|channel|>analysis` messages are reasoning, `final` is the answer,
`commentary to=functions.NAME ... <|message|>{json}` is a tool call.

The generation prompt ends with `<|start|>assistant`; later messages start with
`<|start|>assistant`; a message ends with `<|end|>` (or the `<|call|>`/`<|return|>` stop tokens,
which never reach the text). Parse-only: no grammar is built for this format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llm_server.tools.parsers import ParsedCall, ParseResult, ToolParser, held_back, json_end
from llm_server.tools.reasoning import Split

START, MESSAGE, END = "<|start|>", "<|message|>", "<|end|>"
MARKERS = ("<|channel|>", MESSAGE, END, START, "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")


@dataclass(frozen=True)
class Message:
    channel: str | None
    recipient: str | None  # the function a commentary message calls
    body: str
    closed: bool
    at: int  # where the message (its <|start|> or header) starts in the text


def messages(text: str, final: bool) -> list[Message]:
    """The messages so far; the last one may be open (body held back before a forming marker)."""
    out, pos = [], 0
    while pos < len(text):
        begin = pos
        if text.startswith(START, pos):
            pos += len(START)
        head_end = text.find(MESSAGE, pos)
        if head_end < 0:
            break  # the header is still being written
        header = text[pos:head_end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body_at = head_end + len(MESSAGE)
        stop = text.find(END, body_at)
        nxt = text.find(START, body_at)
        if nxt >= 0 and (stop < 0 or nxt < stop):
            stop_at, after = nxt, nxt  # a message ended by a stop token that left no text
        elif stop >= 0:
            stop_at, after = stop, stop + len(END)
        else:
            stop_at = after = -1
        if stop_at < 0:
            body = text[body_at:]
            if not final:
                body = body[: len(body) - max(held_back(body, END), held_back(body, START))]
        else:
            body = text[body_at:stop_at]
        out.append(
            Message(
                channel.group(1) if channel else None,
                recipient.group(1) if recipient else None,
                body,
                stop_at >= 0 or final,
                begin,
            )
        )
        if after < 0:
            break
        pos = after
    return out


class HarmonySplitter:
    """Reasoning = the leading analysis messages; the answer is the raw text after them."""

    opened = False

    def split(self, text: str, final: bool = False) -> Split:
        msgs = messages(text, final)
        first = next((i for i, m in enumerate(msgs) if m.channel != "analysis"), len(msgs))
        thoughts = msgs[:first]
        reasoning = "\n".join(m.body for m in thoughts)
        if first == len(msgs):
            return Split(reasoning, "", final, thinking=bool(thoughts))
        return Split(reasoning, text[msgs[first].at :], True, thinking=bool(thoughts))


class HarmonyParser(ToolParser):
    """Tool calls and the final answer from harmony messages (after the reasoning)."""

    name = "harmony"
    start = START

    def parse(self, text: str, final: bool = False) -> ParseResult:
        content, calls = "", []
        for m in messages(text, final):
            if m.recipient is None:
                if m.channel in ("final", "commentary", None):
                    content += m.body
                continue
            end = json_end(m.body.strip(), 0) if m.body.strip() else None
            if m.closed and end is None:
                return ParseResult(
                    content, tuple(calls), f"the arguments of {m.recipient!r} are not JSON"
                )
            args = m.body.strip() if m.closed else m.body.lstrip()
            calls.append(ParsedCall(m.recipient, args, m.closed))
        return ParseResult(content, tuple(calls))
