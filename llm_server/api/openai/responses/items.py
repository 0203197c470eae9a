"""A Responses `input` array as chat messages (400s name the item's field).

Messages keep their role; `function_call` and `custom_tool_call` items become the assistant's
`tool_calls` (a namespaced function under the name the model sees, a custom tool's `input` as
the argument `input`); `function_call_output` and `custom_tool_call_output` items become `tool`
messages; `reasoning` items the next assistant message's `reasoning_content` (an empty assistant
message of their own when none follows before another message: an answer that was all thinking,
as a stored response keeps it, so a stateless replay renders the prompt the stored one did and
reuses its cached prefix). A call this server
ended `incomplete` (cut off by a token limit, its arguments unfinished) is accepted back as
sent and left out of the prompt, with any output for it: the model never finished that call.
"""

from __future__ import annotations

import json
from typing import Any

from llm_server.api.openai.responses.tools import chat_name
from llm_server.api.shared.errors import invalid
from llm_server.api.shared.images import check_detail, image_part, is_image_part, url_ref

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
CALLS = ("function_call", "custom_tool_call")
OUTPUTS = ("function_call_output", "custom_tool_call_output")


class _Conversation:
    """The chat messages built so far, and the call ids an output may answer."""

    def __init__(self, known_calls: set[str], cut: frozenset[str]) -> None:
        self.out: list[dict[str, Any]] = []
        self.reasoning: dict[int, str] = {}
        self.pending = ""  # reasoning waiting for the assistant message it belongs to
        self.calls = set(known_calls)
        self.cut = set(cut)  # incomplete calls left out of the prompt

    def assistant(self) -> dict[str, Any]:
        """The assistant message a call joins (a new one after any other message)."""
        last = self.out[-1] if self.out else None
        if last is None or last["role"] != "assistant":
            self.out.append({"role": "assistant", "content": ""})
        self._attach()
        return self.out[-1]

    def _attach(self) -> None:
        if self.pending:
            self.reasoning[len(self.out) - 1], self.pending = self.pending, ""

    def message(self, role: str, content: str | list[dict[str, Any]]) -> None:
        if role != "assistant":
            self.flush()
        self.out.append({"role": role, "content": content})
        if role == "assistant":
            self._attach()

    def flush(self) -> None:
        """Reasoning no assistant message or call took: an assistant message of its own."""
        if self.pending:
            self.out.append({"role": "assistant", "content": ""})
            self._attach()


def input_messages(
    raw: Any, known_calls: set[str], cut: frozenset[str] = frozenset()
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Chat messages for `input`, and the reasoning text of assistant messages by index.

    `known_calls`: call ids of earlier turns an output item may answer; `cut`: those of
    earlier calls left incomplete (their outputs are left out too)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], {}
    if not isinstance(raw, list):
        raise invalid("input", "'input' must be a string or an array of input items")
    conv = _Conversation(known_calls, cut)
    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(param, f"{param} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{param}.role", f"role must be one of {', '.join(ROLES)}")
            images = role == "user"
            conv.message(role, content_of(item.get("content"), f"{param}.content", images))
        elif kind in CALLS:
            _add_call(conv, item, param)
        elif kind in OUTPUTS:
            cid = item.get("call_id")
            if isinstance(cid, str) and cid in conv.cut:
                continue
            if not isinstance(cid, str) or cid not in conv.calls:
                raise invalid(
                    f"{param}.call_id",
                    f"no call with call_id {cid!r} precedes this {kind}",
                )
            content = _output(item, f"{param}.output")
            conv.flush()
            conv.out.append({"role": "tool", "tool_call_id": cid, "content": content})
        elif kind == "reasoning":
            conv.pending += _reasoning_text(item, param)
        else:
            raise invalid(
                f"{param}.type",
                f"input item type {kind!r} is not supported; send message, function_call, "
                "function_call_output, custom_tool_call, custom_tool_call_output or reasoning "
                "items",
            )
    conv.flush()
    return conv.out, conv.reasoning


def _add_call(conv: _Conversation, item: dict, param: str) -> None:
    cid, name, ns = item.get("call_id"), item.get("name"), item.get("namespace")
    kind = item["type"]
    if not isinstance(cid, str) or not cid:
        raise invalid(f"{param}.call_id", f"a {kind} item needs a string 'call_id'")
    if not isinstance(name, str) or not name:
        raise invalid(f"{param}.name", f"a {kind} item needs a string 'name'")
    if ns is not None and not isinstance(ns, str):
        raise invalid(f"{param}.namespace", "'namespace' must be a string")
    if item.get("status") == "incomplete":  # cut off: accepted, not shown to the model
        conv.cut.add(cid)
        return
    if kind == "custom_tool_call":
        text = item.get("input")
        if not isinstance(text, str):
            raise invalid(f"{param}.input", "'input' must be a string")
        args = json.dumps({"input": text}, ensure_ascii=False)
    else:
        args = item.get("arguments")
        if not isinstance(args, str) or not _is_object(args):
            raise invalid(f"{param}.arguments", "'arguments' must be a JSON object string")
    conv.calls.add(cid)
    call = {
        "id": cid,
        "type": "function",
        "function": {"name": chat_name(name, ns), "arguments": args},
    }
    conv.assistant().setdefault("tool_calls", []).append(call)


def _is_object(args: str) -> bool:
    try:
        parsed = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
        return False
    return isinstance(parsed, dict)


def content_of(content: Any, param: str, images: bool) -> str | list[dict[str, Any]]:
    """A message's content as one string, or as text and image parts in order when it carries
    an `input_image` (`images`: where one may stand)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or an array of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
            continue
        if kind == "input_image" and images:
            parts.append(_input_image(part, f"{param}[{j}]"))
            continue
        if kind not in TEXT_PARTS:
            also = ", and input_image in user messages and outputs" if kind == "input_image" else ""
            raise invalid(
                f"{param}[{j}].type",
                f"content part type {kind!r} is not supported here; only input_text and "
                f"output_text{also}",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{param}[{j}].text", "a text part needs a string 'text'")
        parts.append({"type": "text", "text": text})
    if not any(is_image_part(p) for p in parts):  # text only: one string, as always
        return "".join(p["text"] for p in parts)
    return parts


def _input_image(part: dict, param: str) -> dict[str, Any]:
    """`{"type": "input_image", "image_url": a data: URL, "detail"}` as an image part."""
    check_detail(part.get("detail"), f"{param}.detail")
    if part.get("file_id") is not None and part.get("image_url") is None:
        raise invalid(
            f"{param}.file_id",
            "input_image 'file_id' is not supported (no Files API for images here); send the "
            "image inline as 'image_url': a data: URL (data:image/png;base64,...)",
        )
    return image_part(url_ref(part.get("image_url"), f"{param}.image_url"))


def _output(item: dict, param: str) -> str | list[dict[str, Any]]:
    output = item.get("output")
    if isinstance(output, list):
        return content_of(output, param, images=True)
    if not isinstance(output, str):
        raise invalid(param, f"'{param}' must be a string or an array of content parts")
    return output


def _reasoning_text(item: dict, param: str) -> str:
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise invalid(f"{param}.{key}", f"'{param}.{key}' must be an array")
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or not isinstance(p.get("text"), str):
                raise invalid(f"{param}.{key}[{j}]", "a reasoning part needs a string 'text'")
            texts.append(p["text"])
        if texts:  # the full reasoning text when given, else its summary
            break
    return "\n".join(texts)
