"""The one generation path every chat-shaped API shares: plan, admit, and the answer's deltas.

`/v1/chat/completions`, `/v1/responses` and `/v1/messages` all translate their request into a
ChatRequest, then run it here: the same planning (template, grammar, parsers), the same
admission (429 before any response byte, S3), the same cancellation (a closed stream or a
client disconnect cancels, S5) and the same output assembly (ChatOutput).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request

from llm_server.api.chat.plan import ChatPlan, plan_chat
from llm_server.api.shared.errors import APIError
from llm_server.api.shared.handling import admit_all, check_prompt, record_finish
from llm_server.api.shared.schemas import ChatRequest, parse_chat
from llm_server.api.shared.streaming import Collected, merge_events
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent, TokenEvent
from llm_server.service import GenerationHandle, ModelService
from llm_server.tools.output import ChatOutput

TAIL = 16  # token ids kept for telling which stop sequence ended an answer


def parse_translated(
    messages: list[dict[str, Any]],
    fields: dict[str, Any],
    service: ModelService,
    rename: Callable[[str | None], str | None],
) -> ChatRequest:
    """An adapter's chat `messages` and other chat `fields` as a ChatRequest under every chat
    rule; a 400 names the adapter's field (`rename`). A message's `reasoning_content` is kept as
    given: the thinking of earlier turns reaches templates that show it (Qwen3 in a tool loop)."""
    body = {
        "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages],
        **fields,
    }
    try:
        chat = parse_chat(
            body,
            service.config.default_max_tokens,
            service.token_id_limit,
            service.sampling_defaults,
        )
    except APIError as exc:
        exc.param = rename(exc.param)
        raise
    merged = tuple(
        {**m, "reasoning_content": src["reasoning_content"]} if "reasoning_content" in src else m
        for m, src in zip(chat.messages, messages, strict=True)
    )
    return replace(chat, messages=merged)


@dataclass(frozen=True)
class Started:
    """A planned and admitted chat request: one handle per choice."""

    plan: ChatPlan
    handles: list[GenerationHandle]


async def start_chat(
    service: ModelService,
    chat: ChatRequest,
    param: str = "messages",
    check_length: Callable[[int], None] | None = None,
) -> Started:
    """Plan `chat` and admit all its choices now, or raise the 400/429/503 (before any byte).

    `param` names the request field an empty or too long prompt is blamed on; `check_length`
    (given the prompt's length in tokens) replaces that check with an adapter's own words."""
    plan = await plan_chat(service, chat)
    if check_length is not None:
        check_length(len(plan.prompt))
    else:
        check_prompt(service, len(plan.prompt), param)
    predicted = None
    if chat.prediction is not None:  # a drafting source (scheduler/drafting.py)
        predicted = tuple(service.tokenizer.encode(chat.prediction, add_special_tokens=False))
    handles = admit_all(
        service,
        [plan.prompt],
        chat.params,
        chat.n,
        list(plan.constraints),
        plan.keep_tokens,
        predicted,
        plan.embeddings,
    )
    return Started(plan, handles)


def assemble(plan: ChatPlan, out: Collected) -> ChatOutput:
    """The parsed answer (reasoning, content, calls) of one collected generation."""
    answer = plan.output()
    for piece in out.pieces:
        answer.feed(piece)
    answer.finish(cut=out.finish is not None and out.finish.reason == FinishReason.LENGTH)
    return answer


@dataclass(frozen=True)
class Finished:
    """The end of a streamed answer: the scheduler's finish event and the assembled answer."""

    event: FinishEvent
    answer: ChatOutput
    tail: tuple[int, ...]  # the last TAIL sampled token ids (the last an EOS id at EOS)


async def answer_deltas(
    request: Request, handle: GenerationHandle, plan: ChatPlan
) -> AsyncIterator[dict | Finished]:
    """One choice's chat deltas (reasoning, content, tool_calls) as they come, then Finished.

    Ends without Finished when the request was cancelled; closing the iterator cancels the
    generation (S5). A failed generation ends with Finished whose event reason is ERROR."""
    answer = plan.output()
    tail: deque[int] = deque(maxlen=TAIL)
    async for _, ev in merge_events([handle]):
        if isinstance(ev, TokenEvent):
            tail.append(ev.token_id)
            for delta in answer.feed(ev.text):
                yield delta
            continue
        if ev.reason == FinishReason.CANCELLED:
            return
        record_finish(request, ev)
        if ev.reason != FinishReason.ERROR:
            for delta in answer.finish(cut=ev.reason == FinishReason.LENGTH):
                yield delta
        yield Finished(ev, answer, tuple(tail))
        return


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def final_deltas(answer: ChatOutput) -> list[dict[str, Any]]:
    """The whole answer as deltas in output order: reasoning, text, then each call."""
    out: list[dict[str, Any]] = []
    if answer.reasoning:
        out.append({"reasoning_content": answer.reasoning})
    content = answer.content
    if content and (not answer.called or content.strip()):
        out.append({"content": content})
    if answer.called:
        for i, call in enumerate(answer.calls):
            fn = call["function"]
            head = {"index": i, "id": call["id"], "function": {"name": fn["name"]}}
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    return out
