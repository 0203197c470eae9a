"""Split a thinking model's output into reasoning (`<think>...</think>`) and the answer."""

from __future__ import annotations

from dataclasses import dataclass

from llm_server.tools.parsers import held_back

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """True when the rendered prompt ends inside `<think>` (Qwen3, SmolLM3 with thinking on)."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


@dataclass(frozen=True)
class Split:
    reasoning: str
    answer: str
    ended: bool  # the thinking is over (or there was none)
    thinking: bool = True  # the output is (or was) in a <think> block


class ReasoningSplitter:
    """`split(text, final)` on the whole output so far; results only grow (safe to stream)."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened  # the prompt already opened <think>

    def split(self, text: str, final: bool = False) -> Split:
        body = text
        if not self.opened:
            lead = text.lstrip()
            if lead.startswith(THINK_START):
                body = lead[len(THINK_START) :]
            elif not final and THINK_START.startswith(lead):
                return Split("", "", False, thinking=False)  # could still become <think>
            else:
                return Split("", text, True, thinking=False)
        end = body.find(THINK_END)
        if end < 0:
            keep = len(body) if final else len(body) - held_back(body, THINK_END)
            return Split(body[:keep].strip("\n"), "", False)  # trailing newlines held back
        answer = body[end + len(THINK_END) :].lstrip()
        return Split(body[:end].strip("\n"), answer, True)
