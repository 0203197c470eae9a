"""The generic tool format for models whose chat template shows no call syntax (SmolLM2, Gemma).

The server, not the template, shows the tools: a system block lists them as JSON and asks for
calls as `<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>` (the Hermes layout, which
the Hermes grammar forces and the Hermes parser reads). Earlier calls and tool results are
written in the same layout as plain text, so any template renders the history.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llm_server.tools.parsers import HermesParser
from llm_server.tools.spec import ChoiceMode, ToolRequest

NAME = "generic"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
HEADER = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions are "
    "described as JSON within <tools></tools> tags:\n<tools>\n"
)
INSTRUCTIONS = (
    "\n</tools>\n\n"
    "To call a function, answer with a JSON object holding the function name and its arguments "
    "within <tool_call></tool_call> tags, and nothing else:\n"
    f'{CALL_START}\n{{"name": "<function-name>", "arguments": {{<args-json-object>}}}}\n{CALL_END}'
)


class GenericParser(HermesParser):
    """Calls of the generic format (the Hermes layout)."""

    name = NAME


def tools_block(req: ToolRequest) -> str:
    """The system text that shows `req`'s callable tools and how to call them."""
    lines = [json.dumps(t.template_dict(), ensure_ascii=False) for t in req.callable()]
    text = HEADER + "\n".join(lines) + INSTRUCTIONS
    if req.choice.mode == ChoiceMode.NAMED:
        text += f"\n\nCall the function {req.choice.name!r} now."
    elif req.choice.mode == ChoiceMode.REQUIRED:
        text += "\n\nCall at least one function now."
    return text


def call_text(call: dict[str, Any]) -> str:
    """One history call (`{"function": {"name", "arguments": dict}}`) in the generic layout."""
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def generic_messages(
    messages: Sequence[dict[str, Any]], req: ToolRequest, into_user: bool = False
) -> list[dict]:
    """`messages` for a template without tool syntax: calls and results as text, and (when
    tools are active) the tools block merged into the leading system message or put first
    (`into_user`: in front of the first user message, for templates without a system turn).

    Consecutive tool results become one user turn, so templates that require alternating
    user/assistant turns still render them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}".lstrip("\n")})
        elif role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool_result": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("tool_result", None)
    if not req.active:
        return out
    block = tools_block(req)
    if into_user:
        at = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if at is not None:
            out[at] = {**out[at], "content": f"{block}\n\n{out[at]['content']}"}
            return out
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip("\n")}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
