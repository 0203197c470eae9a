"""Responses tools as chat tools, and chat calls back as Responses call items.

Function tools pass through. A `namespace` tool's functions (Codex's multi-agent tools) are
shown to the model as `<namespace>__<name>`; a call to one comes back as a `function_call`
item with `name` and `namespace`, as OpenAI returns it. A `custom` (free-form) tool is shown
as a function of one string argument, `input`; a call to one comes back as a
`custom_tool_call` item whose `input` is that string. Hosted tools that need OpenAI's servers
(web search, file search, code interpreter, ...) are left out of the prompt: the ToolMap lists
their types (the response's `x-llm-server-dropped-tools` header).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from llm_server.api.shared.errors import invalid

SEP = "__"  # between a namespace and its function's name in the name the model sees
# hosted tool types: they run on OpenAI's servers (or need its models), so they are dropped
HOSTED = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer",
    "computer_use_preview",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "tool_search",
    "programmatic_tool_calling",
)
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "the tool's input, as text"}},
    "required": ["input"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Target:
    """What a chat function name stands for in the Responses API."""

    name: str
    namespace: str | None = None
    custom: bool = False


@dataclass
class ToolMap:
    """The request's tools: chat name -> Target, chat tools[k] -> its Responses field."""

    targets: dict[str, Target] = field(default_factory=dict)
    params: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def target(self, chat_name: str) -> Target:
        """The Responses tool a call names (a plain function when the name is not known)."""
        return self.targets.get(chat_name) or Target(chat_name)

    def param(self, chat_param: str) -> str:
        """A chat field about `tools[k]...` as the Responses field it came from."""
        if not chat_param.startswith("tools["):
            return chat_param
        k, _, rest = chat_param[len("tools[") :].partition("]")
        if not k.isdigit() or int(k) >= len(self.params):
            return chat_param
        return self.params[int(k)] + rest.replace(".function", "", 1)


def chat_name(name: str, namespace: str | None) -> str:
    """The function name the model sees (and writes) for `name` in `namespace`."""
    return f"{namespace}{SEP}{name}" if namespace else name


def chat_tools(tools: Any) -> tuple[list | None, ToolMap]:
    """`tools` in the chat shape (namespaces flattened, custom tools as functions, hosted
    tools dropped) and the map back."""
    tmap = ToolMap()
    if tools is None:
        return None, tmap
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be an array of tools")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        param = f"tools[{i}]"
        if kind in ("function", "custom"):
            out.append(_function(t, param, None, None, tmap))
        elif kind == "namespace":
            out += _namespace(t, param, tmap)
        elif kind in HOSTED:
            if kind not in tmap.dropped:
                tmap.dropped.append(kind)
        else:
            raise invalid(
                f"{param}.type",
                f"tool type {kind!r} is not supported; send function, custom or namespace tools "
                f"(hosted tools such as web_search are left out)",
            )
    return out, tmap


def _namespace(t: dict, param: str, tmap: ToolMap) -> list[dict[str, Any]]:
    ns, inner = t.get("name"), t.get("tools")
    if not isinstance(ns, str) or not ns:
        raise invalid(f"{param}.name", "a namespace tool needs a string 'name'")
    if not isinstance(inner, list) or not inner:
        raise invalid(f"{param}.tools", "a namespace tool needs a non-empty 'tools' array")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise invalid(f"{param}.description", "the description must be a string")
    out = []
    for j, fn in enumerate(inner):
        kind = fn.get("type") if isinstance(fn, dict) else None
        if kind not in ("function", "custom"):
            raise invalid(
                f"{param}.tools[{j}].type", "a namespace holds only function and custom tools"
            )
        out.append(_function(fn, f"{param}.tools[{j}]", ns, desc, tmap))
    return out


def _function(
    t: dict, param: str, ns: str | None, ns_desc: str | None, tmap: ToolMap
) -> dict[str, Any]:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{param}.name", f"{param} needs a string 'name'")
    custom = t["type"] == "custom"
    fn: dict[str, Any] = {"name": chat_name(name, ns)}
    desc = t.get("description")
    if custom:
        desc = _custom_description(desc, t.get("format"), param)
    if ns_desc and isinstance(desc, str):
        desc = f"{ns_desc}\n{desc}"
    if desc is not None:
        fn["description"] = desc
    if custom:
        fn |= {"parameters": CUSTOM_PARAMETERS, "strict": False}
    else:
        if t.get("parameters") is not None:
            fn["parameters"] = t["parameters"]
        fn["strict"] = t.get("strict", True)  # the Responses default
    tmap.targets[fn["name"]] = Target(name, ns, custom)
    tmap.params.append(param)
    return {"type": "function", "function": fn}


def _custom_description(desc: Any, fmt: Any, param: str) -> Any:
    """A custom tool's description with its input format (a grammar is shown, not enforced)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return desc
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        raise invalid(f"{param}.format.type", "a custom tool's format is 'text' or 'grammar'")
    definition = fmt.get("definition")
    if not isinstance(definition, str):
        raise invalid(f"{param}.format.definition", "a grammar format needs a 'definition'")
    syntax = fmt.get("syntax") or "lark"
    note = f"The input follows this {syntax} grammar:\n{definition}"
    return f"{desc}\n\n{note}" if isinstance(desc, str) and desc else note


def chat_tool_choice(choice: Any, tmap: ToolMap) -> Any:
    """`tool_choice` in the chat shape; a named function may be in a namespace or custom."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name, ns = choice["name"], choice.get("namespace")
        wanted = chat_name(name, ns if isinstance(ns, str) else None)
        if wanted not in tmap.targets:  # a namespaced function named without its namespace
            found = [k for k, t in tmap.targets.items() if t.name == name]
            wanted = found[0] if len(found) == 1 else wanted
        return {"type": "function", "function": {"name": wanted}}
    raise invalid(
        "tool_choice",
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
        '"name": ...}',
    )


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote (`{"input": "..."}`): the
    string so far when they were cut off; the arguments themselves when whole but otherwise."""
    for tail in ("", '"}', "}"):  # whole, then cut inside the string, then after it
        try:
            value = json.loads(arguments + tail)
        except json.JSONDecodeError:
            continue
        text = value.get("input") if isinstance(value, dict) else None
        if isinstance(text, str):
            return text
        return "" if tail else arguments
    return ""


def json_object(text: str) -> bool:
    """True when `text` is a JSON object (a complete call's arguments)."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
