"""llguidance grammars that make tool calls valid by construction (lark with `%json` schemas).

Forced calls (`tool_choice` required or named) constrain the whole answer to the family's call
syntax around each function's parameter schema. Under `auto` the grammar is lazy: free text until
the call-start marker (a lazy lexeme), then the call is constrained and only more calls may
follow. For a prompt that opened `<think>`, the thinking is free text up to `</think>` and the
grammar applies to the answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llm_server.tools.reasoning import THINK_END
from llm_server.tools.spec import ToolRequest, ToolSpec

# Compact JSON separators (as constrained.JSON_OPTIONS): no free whitespace to wander into.
_X_GUIDANCE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEXT = "TEXT: /(.|\\n)*/"


class NoGrammar(ValueError):
    """This family/choice has no grammar (the output is only parsed)."""


def _lit(s: str) -> str:
    return json.dumps(s)


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _X_GUIDANCE})


def _call_schema(tools: tuple[ToolSpec, ...], args_key: str) -> dict[str, Any]:
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, args_key: t.parameters},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }


def _xml_call(tools: tuple[ToolSpec, ...]) -> tuple[str, list[str]]:
    """Qwen3-Coder: `<function=f>` then one `<parameter=p>` block per property, schema order."""
    # a string value is free text up to the first "\n</parameter>" (a lazy lexeme)
    rules, alts = [r'str_value[lazy]: TEXT "\n</parameter>\n"'], []
    for i, t in enumerate(tools):
        props = t.parameters.get("properties") or {}
        required = set(t.parameters.get("required") or ())
        parts = []
        for k, sub in props.items():
            head = _lit(f"<parameter={k}>\n")
            if sub.get("type") == "string":
                block = f"{head} str_value"
            else:
                block = f'{head} {_json(sub)} "\\n</parameter>\\n"'
            parts.append(f"({block})" + ("" if k in required else "?"))
        rules.append(f"fn_{i}: {_lit(f'<function={t.name}>' + chr(10))} {' '.join(parts)}")
        alts.append(f"fn_{i}")
    body = f'"\\n" ({" | ".join(alts)}) "</function>\\n</tool_call>"'
    return body, rules


def _body(family: str, tools: tuple[ToolSpec, ...], marker: str) -> tuple[str, list[str]]:
    """The text after the call-start marker, and helper rules."""
    if family in ("hermes", "generic"):
        return f'"\\n" {_json(_call_schema(tools, "arguments"))} "\\n</tool_call>"', []
    if family == "qwen3_coder":
        return _xml_call(tools)
    raise NoGrammar(family)


def tool_grammar(
    family: str, req: ToolRequest, specials: Mapping[str, int], thinking_open: bool
) -> str:
    """The lark grammar for `req` under `family`; NoGrammar when it only parses.

    `specials`: marker text -> id for the markers that are single special tokens
    ([TOOL_CALLS], [ARGS]); the grammar names those by id.
    """
    tools = req.callable()
    rules = ["%llguidance {}", TEXT]
    if family in ("hermes", "qwen3_coder", "generic"):
        body, extra = _body(family, tools, "<tool_call>")
        rules += extra
        if req.forced:
            rules.append(f'call: "<tool_call>" {body}')
            # generic: no newline between calls; a small model offered one writes calls forever
            sep = "" if family == "generic" else '"\\n" '
            answer = f"call ({sep}call)*" if req.parallel else "call"
        else:  # free text, or text up to the first call and then only calls
            rules.append('call_trig[lazy]: TEXT "<tool_call>"')
            more = f'(/[ \\n]*/ "<tool_call>" {body})*' if req.parallel else ""
            rules.append(f"calls: call_trig {body} {more} /[ \\n]*/")
            answer = "TEXT | calls"
    elif family == "llama3_json":
        call = _json(_call_schema(tools, "parameters"))
        calls = f'{call} ("; " {call})*' if req.parallel else call
        if req.forced:
            answer = calls
        else:  # as the parser reads it: an answer that opens with `{` is a call
            rules.append(r"PLAIN: /(\s*[^{\s](.|\n)*)?/")
            answer = f"PLAIN | /\\s*/ {calls}"
    elif family == "mistral":
        answer = _mistral(rules, tools, req, specials)
    else:
        raise NoGrammar(family)
    return _with_thinking(rules, answer, thinking_open)


def _marker(text: str, specials: Mapping[str, int]) -> str:
    return f"<[{specials[text]}]>" if text in specials else _lit(text)


def _mistral(
    rules: list[str], tools: tuple[ToolSpec, ...], req: ToolRequest, specials: Mapping[str, int]
) -> str:
    """`[TOOL_CALLS][{..}, ..]`, or `[TOOL_CALLS]name[ARGS]{..}` per call when the tokenizer
    has [ARGS] (v11); under auto, free text until [TOOL_CALLS]."""
    tc = _marker("[TOOL_CALLS]", specials)
    if "[ARGS]" in specials:
        args = _marker("[ARGS]", specials)
        alts = " | ".join(f"{_lit(t.name)} {args} {_json(t.parameters)}" for t in tools)
        rules.append(f"one: {alts}")
        body = f"one ({tc} one)*" if req.parallel else "one"
    else:
        calls = {"type": "array", "items": _call_schema(tools, "arguments"), "minItems": 1}
        if not req.parallel:
            calls["maxItems"] = 1
        body = _json(calls)
    if req.forced:
        return f"{tc} {body}"
    if "[TOOL_CALLS]" in specials:  # a special token never occurs inside TEXT
        return f"TEXT | TEXT {tc} {body}"
    rules.append('call_trig[lazy]: TEXT "[TOOL_CALLS]"')
    return f"TEXT | call_trig {body}"


def answer_grammar(schema: dict[str, Any], thinking_open: bool) -> str:
    """A response_format schema applied to the answer after the thinking."""
    return _with_thinking(["%llguidance {}", TEXT], _json(schema), thinking_open)


def _with_thinking(rules: list[str], answer: str, thinking_open: bool) -> str:
    if thinking_open:
        rules.append(f"think[lazy]: TEXT {_lit(THINK_END)}")
        rules.append(f"start: think /[ \\n]*/ {answer}")
    else:
        rules.append(f"start: {answer}")
    return "\n".join(rules) + "\n"
