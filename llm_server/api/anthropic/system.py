"""Where Anthropic `role: "system"` messages inside `messages` go.

Claude Code sends such messages in every conversation (skills, agent lists). A chat template
either shows a system turn wherever one stands (ChatML-style templates: SmolLM2, Qwen, Hermes,
Llama 3) or only a leading one (Gemma and Mistral raise, others drop the rest). One probe render
per tokenizer tells which: where they render in place they stay where they stand, otherwise
their text is folded, in order, into the system prompt (the one leading system message).
"""

from __future__ import annotations

import weakref
from typing import Any

from llm_server.tokenizer import ChatTemplateError, Tokenizer

_PROBE = [
    {"role": "system", "content": "probe-system-0"},
    {"role": "user", "content": "probe-user-1"},
    {"role": "system", "content": "probe-system-1"},
    {"role": "assistant", "content": "probe-assistant-1"},
    {"role": "system", "content": "probe-system-2"},
    {"role": "user", "content": "probe-user-2"},
]
_IN_ORDER = [m["content"] for m in _PROBE]
_placement: weakref.WeakKeyDictionary[Tokenizer, bool] = weakref.WeakKeyDictionary()


def renders_system_in_place(tok: Tokenizer) -> bool:
    """True when the template shows system turns after the first where they stand (cached)."""
    known = _placement.get(tok)
    if known is None:
        known = _probe(tok)
        _placement[tok] = known
    return known


def _probe(tok: Tokenizer) -> bool:
    try:
        text = tok.render_chat([dict(m) for m in _PROBE])
    except ChatTemplateError:
        return False
    at = [text.find(s) for s in _IN_ORDER]
    return all(a >= 0 for a in at) and at == sorted(at)


def place_system(
    tok: Tokenizer, system: str, messages: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with the top-level `system` first; later system messages kept where they stand
    or folded into that first one (blank lines between), as the template allows."""
    lead = [{"role": "system", "content": system}] if system else []
    if renders_system_in_place(tok):
        return lead + messages
    folded = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    text = "\n\n".join([system, *folded] if system else folded)
    return ([{"role": "system", "content": text}] if text else []) + rest
