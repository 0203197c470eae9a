"""A chat request's messages as a vision model's chat template takes them, and the keys of
its images' spans (pure functions: no model, no MLX)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the chat template takes them: image parts as `{"type": "image"}` (the
    pixels never reach the template), other parts and plain strings as they are (the
    tokenizer shows strings as text parts to a template that wants them, `Tokenizer`)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = [{"type": "image"} if _is_image(p) else p for p in content]
            out.append({**m, "content": parts})
        else:
            out.append(m)
    return out


def lift_tool_images(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results that carry images (an agent's screenshot, a file it read) as templates can
    show them: a tool message keeps its text parts as its content, and the images of a run of
    tool messages open the next user turn (one made for them when none follows); no template
    shows an image inside a tool turn, and most print a list there as it is."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "tool" and isinstance(content, list):
            pending += [p for p in content if _is_image(p)]
            text = [p.get("text", "") for p in content if p.get("type") == "text"]
            out.append({**m, "content": "\n".join(text)})
            continue
        if pending and m.get("role") == "user":
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            out.append({**m, "content": [*pending, *parts]})
            pending = []
            continue
        if pending and m.get("role") != "tool":
            out.append({"role": "user", "content": pending})
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": pending})
    return out


def merge_user_turns(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive user turns as one (parts in order), where either holds parts: the generic
    tool format turns tool results into a user turn, and the images lifted out of them follow."""
    out: list[dict[str, Any]] = []
    for m in messages:
        prev = out[-1] if out else None
        lists = prev is not None and (
            isinstance(m.get("content"), list) or isinstance(prev.get("content"), list)
        )
        if prev is not None and lists and prev.get("role") == m.get("role") == "user":
            out[-1] = {**prev, "content": [*_parts(prev["content"]), *_parts(m["content"])]}
        else:
            out.append(m)
    return out


def _parts(content: Any) -> list[dict[str, Any]]:
    return content if isinstance(content, list) else [{"type": "text", "text": content or ""}]


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def image_runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of `positions` (ascending) as (first index, end index) into it."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


def span_key(digest: str, run: int) -> bytes:
    """The prefix cache's key of an image's `run`-th span: its pixels' digest and the run."""
    return hashlib.sha256(f"image:{digest}:{run}".encode()).digest()
