"""Agent conversations for `llm-benchmark --workload agent`, built from a recorded request.

A coding agent opens with a long prefix (instructions, skills, tool definitions) and then, on
every turn, resends all of it plus the growing history: its own short answer with a tool call,
the tool's output, a few words from the user. The first turn here is an agent's recorded first
request (tests/data/agents, as tests/agents' RecordingProxy wrote it: Responses, Messages or
chat body) turned into plain chat messages; each later turn is the previous turn's messages
plus a scripted assistant tool call and one user message carrying the tool's result and a
short user line. Everything is
deterministic, so every server sees the same prompts, and every turn's prompt starts with the
whole previous prompt (the part a prefix cache can reuse).

The tool call is written in the assistant's text (`<tool_call>{json}</tool_call>`) and its result
in a user message (`<tool_response>...</tool_response>`, as Hermes templates render results),
not as `tool_calls` and a `tool` message, and the tools as text in the system message, not as
`tools`: a template without tool support (SmolLM2's) cannot render `tool_calls`, rapid-mlx
refuses a `tool` message whose id no `tool_calls` names, and vllm-mlx merges consecutive
messages of one role, so plain alternating text is the one prompt every server renders alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

LOG_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "agents"
LOGS = {
    "codex": "codex_0.171.0_first_request.json",
    "claude-code": "claude_code_2.1.332_first_request.json",
}
SHELL = re.compile(r"bash|shell|exec", re.IGNORECASE)  # the tool the scripted calls use
COMMANDS = [  # the scripted tool calls, one per turn after the first (cycled)
    "ls -la src tests",
    "sed -n 1,60p src/inventory/parser.py",
    "rg -n 'def parse_' src",
    "python -m pytest -q tests/test_parser.py",
    "git diff --stat",
    "sed -n 60,120p src/inventory/parser.py",
]
USER_LINES = [
    "Keep going; the parser should reject empty lines.",
    "Good. Now check the other callers.",
    "Run the tests again after the change.",
    "Summarize what is left in one line.",
]


@dataclass(frozen=True)
class Conversation:
    id: str
    source: str  # the request log it was built from
    turns: list[list[dict]]  # each turn's full chat messages


def load_log(name_or_path: str) -> dict:
    """A recorded request: a LOGS name ("codex", "claude-code") or a JSON file with a `body`."""
    path = Path(name_or_path) if name_or_path not in LOGS else LOG_DIR / LOGS[name_or_path]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"agent log {name_or_path!r}: cannot read {path} ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("body"), dict):
        raise ValueError(f"agent log {path}: expected a JSON object with a 'body' object")
    return data


def _text(content) -> str:
    """Text of a message's content: a string or a list of text blocks (input_text, text)."""
    if isinstance(content, str):
        return content
    parts = [b.get("text", "") for b in content or [] if isinstance(b, dict)]
    return "\n\n".join(p for p in parts if p)


def _tools_text(tools: list[dict]) -> str:
    lines = [json.dumps(t, separators=(",", ":"), ensure_ascii=False) for t in tools]
    return (
        '# Tools\n\nCall a tool by answering with <tool_call>{"name": ..., "arguments": ...}'
        "</tool_call>. Available tools, one JSON definition per line:\n" + "\n".join(lines)
    )


def first_turn(body: dict) -> list[dict]:
    """The recorded first request as [system, user]: instructions and developer/system text
    (with the tools) in the system message, the user's messages in the user message."""
    system: list[str] = []
    user: list[str] = []
    if body.get("instructions"):
        system.append(_text(body["instructions"]))
    if body.get("system"):
        system.append(_text(body["system"]))
    for item in body.get("input") or body.get("messages") or []:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        role = item.get("role")
        text = _text(item.get("content"))
        if text:
            (user if role == "user" else system).append(text)
    if body.get("tools"):
        system.append(_tools_text(body["tools"]))
    if not system or not user:
        raise ValueError("agent log: the request has no system/developer text or no user text")
    return [
        {"role": "system", "content": "\n\n".join(system)},
        {"role": "user", "content": "\n\n".join(user)},
    ]


def _shell_tool(body: dict) -> tuple[str, str]:
    """Name of the request's shell tool (else its first) and its first required argument
    (exec_command/cmd, Bash/command); ("shell", "command") when the request has none."""
    tools = body.get("tools") or []
    shell = [t for t in tools if SHELL.search(str(t.get("function", t).get("name", "")))]
    for tool in shell + tools:
        fn = tool.get("function", tool)
        schema = fn.get("parameters") or fn.get("input_schema") or {}
        required = schema.get("required") or list(schema.get("properties") or {})
        if fn.get("name") and required:
            return fn["name"], required[0]
    return "shell", "command"


def tool_result(conversation: int, turn: int, lines: int) -> str:
    """A deterministic tool output: `lines` lines of a Python module, different per turn."""
    out = [f"# src/inventory/module_{conversation}_{turn}.py"]
    for i in range(lines):
        k = conversation * 1000 + turn * 100 + i
        if i % 4 == 0:
            out.append(f"def parse_field_{k}(line: str) -> int:")
        elif i % 4 == 1:
            out.append(f"    value = line.split(',')[{i % 7}].strip()  # column {k % 13}")
        elif i % 4 == 2:
            out.append(f"    return int(value or {k % 97}) * {i % 11 + 1}")
        else:
            out.append("")
    return "\n".join(out)


def build_conversation(
    log: dict, turns: int, conversation: int = 0, result_lines: int = 60
) -> Conversation:
    """`turns` prompts, each the previous one plus an assistant tool call, its result and a
    user line. `conversation` varies the scripted content (conversations share only the
    recorded prefix)."""
    if turns < 1:
        raise ValueError("an agent conversation needs at least 1 turn")
    body = log["body"]
    name, arg = _shell_tool(body)
    messages = first_turn(body)
    if conversation:
        messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n\n(task {conversation})"}  # fmt: skip
    out = [messages]
    for t in range(1, turns):
        command = COMMANDS[(t - 1 + conversation) % len(COMMANDS)]
        call = json.dumps({"name": name, "arguments": {arg: command}})
        result = tool_result(conversation, t, result_lines)
        line = USER_LINES[(t - 1) % len(USER_LINES)]
        messages = [
            *messages,
            {"role": "assistant", "content": f"Let me look.\n<tool_call>{call}</tool_call>"},
            {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>\n\n{line}"},
        ]
        out.append(messages)
    source = str(log.get("path", "")) or "?"
    return Conversation(f"conv-{conversation}", source, out)


def check_fits(
    conv: Conversation, count_prompt: Callable[[list[dict]], int], context: int, max_tokens: int
) -> list[int]:
    """Each turn's prompt tokens (by `count_prompt`, e.g. the model's chat template); ValueError
    when the last turn's prompt plus `max_tokens` exceeds `context`."""
    sizes = [count_prompt(m) for m in conv.turns]
    if sizes[-1] + max_tokens > context:
        raise ValueError(
            f"turn {len(sizes)} of the agent conversation is {sizes[-1]} prompt tokens; with "
            f"{max_tokens} new tokens that exceeds the model's {context}-token context "
            "(fewer --agent-turns, or a longer-context model)"
        )
    return sizes
