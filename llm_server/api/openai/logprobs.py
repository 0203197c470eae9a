"""OpenAI `logprobs` objects: the chat shape, and the legacy completions shape for generated
tokens and for scored prompts (C5).

Shape: `{"tokens": [str], "token_logprobs": [float|None], "top_logprobs": [{str: float}|None],
"text_offset": [int]}`; each text offset is where that token's string starts in the choice text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llm_server.decoding import TokenLogprob
from llm_server.scheduler.scorer import ScoredPrompt

TokenStrings = Callable[[Sequence[int]], list[str]]


def _offsets(strings: list[str], start: int) -> list[int]:
    out = []
    pos = start
    for s in strings:
        out.append(pos)
        pos += len(s)
    return out


def _top_dict(top: Sequence[tuple[int, float]], token_strings: TokenStrings) -> dict[str, float]:
    names = token_strings([tid for tid, _ in top])
    # Two ids can share a string; keep the better (first, best-first order) logprob.
    out: dict[str, float] = {}
    for name, (_, lp) in zip(names, top, strict=True):
        out.setdefault(name, lp)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], token_strings: TokenStrings) -> dict:
    """The chat `logprobs` object: per token its string, logprob, bytes and alternatives."""

    def item(name: str, lp: float) -> dict:
        return {"token": name, "logprob": lp, "bytes": list(name.encode("utf-8"))}

    content = []
    for e in entries:
        names = token_strings([e.token_id, *(tid for tid, _ in e.top)])
        top = [item(n, lp) for n, (_, lp) in zip(names[1:], e.top, strict=True)]
        content.append({**item(names[0], e.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_strings: TokenStrings, offset: int = 0
) -> dict:
    """Logprobs of generated tokens; `offset` is where the first one starts in the text."""
    strings = token_strings([e.token_id for e in entries])
    return {
        "tokens": strings,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_top_dict(e.top, token_strings) for e in entries],
        "text_offset": _offsets(strings, offset),
    }


def scored_choice(
    index: int,
    scored: ScoredPrompt,
    prompt_text: str,
    token_strings: TokenStrings,
    decode: Callable[[Sequence[int]], str],
) -> dict:
    """One C5 choice: the prompt (plus the greedy next token) with every token's logprob."""
    strings = token_strings(scored.tokens)
    text = prompt_text
    if scored.generated is not None:
        text += decode([scored.generated])
    return {
        "index": index,
        "text": text,
        "logprobs": {
            "tokens": strings,
            "token_logprobs": list(scored.token_logprobs),
            "top_logprobs": [
                None if top is None else _top_dict(top, token_strings)
                for top in scored.top_logprobs
            ],
            "text_offset": _offsets(strings, 0),
        },
        "finish_reason": "length",
    }
