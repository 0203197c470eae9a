"""Parse the tool and reasoning fields of a chat request (`tools`, `tool_choice`, history calls).

Everything here reaches the model through its chat template; bad shapes raise a 400 naming the
field.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match

from llm_server.api.shared.errors import invalid
from llm_server.tools.spec import ChoiceMode, ToolChoice, ToolRequest, ToolSpec

# OpenAI's rule for function names
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# apply_chat_template's own parameters: a kwarg must not replace the template, the messages or
# the tokenization settings.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)  # fmt: skip


def parse_tools(body: dict) -> ToolRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` into a ToolRequest (400 on bad shapes)."""
    raw = body.get("tools")
    tools: list[ToolSpec] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid("tools", "'tools' must be an array of function tools")
        for i, t in enumerate(raw):
            tools.append(_tool(t, f"tools[{i}]"))
        names = [t.name for t in tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise invalid("tools", f"function name {dup!r} appears more than once in 'tools'")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    return ToolRequest(
        tools=tuple(tools),
        choice=_choice(body.get("tool_choice"), tools),
        parallel=True if parallel is None else parallel,
    )


def _tool(t: Any, param: str) -> ToolSpec:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise invalid(f"{param}.type", f"{param} must be an object with type 'function'")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{param}.function", f"{param}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise invalid(
            f"{param}.function.name",
            f"{param}.function.name must be 1-64 letters, digits, '_' or '-'",
        )
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise invalid(f"{param}.function.description", "the description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise invalid(f"{param}.function.parameters", "parameters must be a JSON schema object")
    _check_schema(params, f"{param}.function.parameters", name)
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{param}.function.strict", "'strict' must be a boolean")
    return ToolSpec(name=name, description=desc, parameters=params, strict=bool(strict))


def _check_schema(schema: dict, param: str, name: str) -> None:
    """400 naming the first bad keyword of a tool schema that is not a JSON Schema, as the hosted
    APIs answer (the draft its `$schema` names, else 2020-12)."""
    problems = _schema_problems(json.dumps(schema, sort_keys=True))
    if problems is None:
        return
    draft, found = problems
    where, _ = found[0]
    listed = "; ".join(f"at {f'{w!r}' if w else 'the top'}: {m}" for w, m in found[:3])
    raise invalid(
        f"{param}.{where}" if where else param,
        f"the schema of tool {name!r} is not a valid JSON Schema ({draft}): {listed}",
    )


@lru_cache(maxsize=1024)  # agents send the same tools every turn; a check costs milliseconds
def _schema_problems(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(draft, [(keyword path, what is wrong)]) in the schema's order, or None when valid.
    Formats are not checked: a `pattern` in ECMA-262 syntax that Python's `re` rejects is no
    error of the client's."""
    schema = json.loads(text)
    cls = validators.validator_for(schema, default=Draft202012Validator)
    errors = list(cls(cls.META_SCHEMA).iter_errors(schema))
    if not errors:
        return None
    found: dict[tuple[str, ...], str] = {}
    for error in errors:
        leaf = _leaf(error)
        found.setdefault(tuple(map(str, leaf.absolute_path)), leaf.message)
    draft = cls.__name__.removesuffix("Validator").replace("Draft", "Draft ")
    if len(draft) == len("Draft 202012"):
        draft = f"{draft[:-2]}-{draft[-2:]}"
    return draft, [(".".join(path), found[path]) for path in sorted(found)]


def _leaf(error: ValidationError) -> ValidationError:
    """The sub-error that says most: the deepest in the schema (an `anyOf` in the meta-schema
    hides it), a wrong value before a wrong type, the most relevant of those."""
    leaves, todo = [], [error]
    while todo:
        e = todo.pop()
        if e.context:
            todo.extend(e.context)
        else:
            leaves.append(e)
    depth = max(len(e.absolute_path) for e in leaves)
    deepest = [e for e in leaves if len(e.absolute_path) == depth]
    # of "12 is not of type 'array'" and "12 is not one of [the type names]", the second
    told = [e for e in deepest if e.validator != "type"] or deepest
    return best_match(told) or error


def _choice(raw: Any, tools: list[ToolSpec]) -> ToolChoice:
    if raw is None:
        return ToolChoice(ChoiceMode.AUTO)
    if isinstance(raw, str):
        modes = {"none": ChoiceMode.NONE, "auto": ChoiceMode.AUTO, "required": ChoiceMode.REQUIRED}
        if raw not in modes:
            raise invalid(
                "tool_choice",
                "'tool_choice' must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
            )
        if modes[raw] == ChoiceMode.REQUIRED and not tools:
            raise invalid("tool_choice", "'tool_choice' 'required' needs a non-empty 'tools'")
        return ToolChoice(modes[raw])
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "tool_choice",
            "'tool_choice' as an object must be "
            '{"type": "function", "function": {"name": "..."}}',
        )
    if name not in {t.name for t in tools}:
        raise invalid(
            "tool_choice", f"tool_choice names function {name!r}, which is not in 'tools'"
        )
    return ToolChoice(ChoiceMode.NAMED, name)


def message_extras(m: dict, i: int) -> dict[str, Any]:
    """The tool fields of messages[i] in the shape chat templates read."""
    out: dict[str, Any] = {}
    role = m.get("role")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise invalid(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
        if not isinstance(calls, list):
            raise invalid(f"messages[{i}].tool_calls", "'tool_calls' must be an array")
        out["tool_calls"] = [
            _history_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)
        ]
    if role == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise invalid(f"messages[{i}].tool_call_id", "a tool message needs a 'tool_call_id'")
        out["tool_call_id"] = cid
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise invalid(f"messages[{i}].name", "'name' must be a string")
        out["name"] = name
    return out


def _history_call(c: Any, param: str) -> dict[str, Any]:
    if not isinstance(c, dict) or c.get("type", "function") != "function":
        raise invalid(param, f"{param} must be an object with type 'function'")
    fn = c.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid(f"{param}.function", f"{param}.function needs a string 'name'")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise invalid(
                f"{param}.function.arguments", f"{param}.function.arguments is not valid JSON"
            ) from None
    if not isinstance(args, dict):
        raise invalid(f"{param}.function.arguments", "arguments must be a JSON object")
    cid = c.get("id")
    if cid is not None and not isinstance(cid, str):
        raise invalid(f"{param}.id", "the call id must be a string")
    # arguments as a dict: templates render it with tojson (Qwen, Llama, Mistral)
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def parse_template_kwargs(body: dict) -> dict[str, Any]:
    """`chat_template_kwargs` plus `reasoning_effort`: extra variables for the chat template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    reserved = RESERVED_TEMPLATE_KWARGS & kwargs.keys()
    if reserved:
        key = sorted(reserved)[0]
        raise invalid("chat_template_kwargs", f"chat_template_kwargs must not set {key!r}")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid(
                "reasoning_effort",
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
            )
        kwargs = {**kwargs, "reasoning_effort": effort}
    return kwargs
