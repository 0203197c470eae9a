"""Turn a chat request into what generation needs: the prompt (with `tools=`), the grammar
(tool calls, or response_format after thinking), the call parser and the reasoning splitter."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from llm_server.api.shared.errors import APIError, invalid
from llm_server.api.shared.schemas import ChatRequest
from llm_server.decoding import LogitsConstraint
from llm_server.engines.plan import EmbeddingSpan
from llm_server.images import has_images
from llm_server.service import ModelService
from llm_server.tokenizer import ChatTemplateError
from llm_server.tools.budget import ThinkingBudget
from llm_server.tools.constrained import (
    ConstraintError,
    build_constraint,
    build_lark_constraint,
    schema_for,
)
from llm_server.tools.generic import NAME as GENERIC
from llm_server.tools.generic import generic_messages
from llm_server.tools.grammar import NoGrammar, answer_grammar, tool_grammar
from llm_server.tools.harmony import MARKERS as HARMONY_MARKERS
from llm_server.tools.harmony import HarmonyParser, HarmonySplitter
from llm_server.tools.output import ChatOutput
from llm_server.tools.parsers import ToolParser
from llm_server.tools.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningSplitter,
    prompt_opens_thinking,
)
from llm_server.tools.registry import PARSERS
from llm_server.tools.spec import ToolRequest
from llm_server.vision.messages import lift_tool_images, merge_user_turns
from llm_server.vision.renderer import ImageRejected, TowerFailed

log = logging.getLogger(__name__)

# Markers that may be special tokens, kept in the decoded text so the parsers see them.
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")
THINK_MARKERS = {"think": (THINK_START, THINK_END), "harmony": HARMONY_MARKERS}


@dataclass(frozen=True)
class ChatPlan:
    prompt: list[int]
    constraints: tuple[LogitsConstraint | None, ...]  # one grammar state per choice (n)
    keep_tokens: frozenset[int]
    parser: str  # the PARSERS key the output is parsed with when tools are active
    tools: ToolRequest
    reasoning: str | None  # "think" or "harmony": reasoning fields are reported
    thinking_open: bool  # the prompt ends inside <think>
    # the images' rows at their placeholder positions in `prompt` (a vision model's; engines/plan.py)
    embeddings: tuple[EmbeddingSpan, ...] = ()

    @property
    def constraint(self) -> LogitsConstraint | None:
        """The first choice's grammar (None: unconstrained)."""
        return self.constraints[0]

    def output(self) -> ChatOutput:
        """A fresh output assembler for one choice."""
        parser: ToolParser | None = None
        if self.tools.active:
            parser = PARSERS[self.parser](self.tools.tools)
        max_calls = None if self.tools.parallel else 1
        splitter: ReasoningSplitter | HarmonySplitter | None = None
        if self.reasoning == "harmony":
            splitter = HarmonySplitter()
            if parser is None:  # the final channel is the answer; no calls without tools
                parser, max_calls = HarmonyParser(), 0
        elif self.reasoning == "think":
            splitter = ReasoningSplitter(self.thinking_open)
        return ChatOutput(parser, splitter, max_calls)


def chat_prompt(service: ModelService, chat: ChatRequest) -> list[int]:
    """The prompt token ids of `chat` through the model's chat template (a template's own
    error is a 400 on `messages`); an image's placeholder positions included."""
    return chat_inputs(service, chat)[0]


def chat_inputs(
    service: ModelService, chat: ChatRequest
) -> tuple[list[int], tuple[EmbeddingSpan, ...]]:
    """The prompt ids of `chat` and its images' embedding spans (none without images)."""
    messages = list(chat.messages)
    if has_images(messages):
        return render_images(service, messages, chat.tools, chat.template_kwargs)
    return render_prompt(service, messages, chat.tools, chat.template_kwargs), ()


def render_images(
    service: ModelService,
    messages: list[dict[str, Any]],
    tools: ToolRequest,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], tuple[EmbeddingSpan, ...]]:
    """`render_prompt` for messages with image parts, through the model's vision renderer
    (its tower runs here: call it off the event loop); a 400 on `messages` where the model
    takes no images or the template rejects them, on the image's field where the processor
    cannot read it; a 500 `vision_error` where the tower fails (that request alone)."""
    vision = service.vision
    if vision is None:
        name = service.config.model_id or "the served model"
        raise invalid("messages", service.vision_error or f"{name} does not take images")
    messages = lift_tool_images(messages)  # a tool result's images open the next user turn

    def generic(into_user: bool = False) -> list[dict[str, Any]]:
        return merge_user_turns(generic_messages(messages, tools, into_user))

    try:
        if service.syntax.tool_parser != GENERIC:
            shown_tools = [t.template_dict() for t in tools.tools] or None
            return vision.render(messages, shown_tools, template_kwargs)
        if tools.active:  # a template that refuses a system turn (Gemma): the first user turn
            try:
                return vision.render(generic(), None, template_kwargs)
            except ChatTemplateError:
                return vision.render(generic(True), None, template_kwargs)
        return vision.render(generic(), None, template_kwargs)
    except ImageRejected as exc:
        raise invalid(exc.field, str(exc)) from None
    except (ChatTemplateError, ValueError) as exc:
        raise invalid("messages", str(exc)) from None
    except Exception as exc:  # the tower, or the vision thread: this request fails alone
        log.exception("vision failed on a request's images")
        message = str(exc) if isinstance(exc, TowerFailed) else "the vision model failed"
        raise APIError(
            500, message, param=getattr(exc, "field", None), code="vision_error"
        ) from None


def render_prompt(
    service: ModelService,
    messages: list[dict[str, Any]],
    tools: ToolRequest,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt ids of `messages` and `tools`: through the template's `tools=`, or in the
    generic format where the template shows no call syntax (a template error is a 400)."""
    tok = service.tokenizer
    if service.syntax.tool_parser != GENERIC:
        shown_tools = [t.template_dict() for t in tools.tools] or None
        return _render(tok, messages, shown_tools, template_kwargs)
    if tools.active:  # a template that refuses a system turn (Gemma): the first user turn
        try:
            return tok.apply_chat_template(generic_messages(messages, tools), None, template_kwargs)
        except ChatTemplateError:
            return _render(tok, generic_messages(messages, tools, True), None, template_kwargs)
    return _render(tok, generic_messages(messages, tools), None, template_kwargs)


def _render(tok, messages: list[dict], tools: list[dict] | None, kwargs) -> list[int]:
    try:
        return tok.apply_chat_template(messages, tools, kwargs)
    except ChatTemplateError as exc:
        raise invalid("messages", str(exc)) from None


async def plan_chat(service: ModelService, chat: ChatRequest) -> ChatPlan:
    """Validate the tool/reasoning fields against the model and build the plan (400s here)."""
    tok, syntax, tools = service.tokenizer, service.syntax, chat.tools
    if tools.active and chat.response_format is not None:
        raise invalid(
            "response_format",
            "response_format cannot be combined with tools unless tool_choice is 'none'",
        )
    if has_images(list(chat.messages)):  # the vision tower runs off the event loop
        prompt, spans = await asyncio.to_thread(chat_inputs, service, chat)
    else:
        prompt, spans = chat_inputs(service, chat)
    tail = tok.decode(prompt[-16:], skip_special_tokens=False)
    thinking_open = syntax.reasoning == "think" and prompt_opens_thinking(tail)
    markers = MARKERS + THINK_MARKERS.get(syntax.reasoning or "", ())
    keep = frozenset(i for m in markers if (i := tok.special_token_id(m)) is not None)
    constraints = tuple([await _constraint(service, chat, thinking_open) for _ in range(chat.n)])
    if chat.thinking_budget is not None and syntax.reasoning == "think":
        constraints = tuple(
            _budgeted(service, chat.thinking_budget, thinking_open, c) for c in constraints
        )
    return ChatPlan(
        prompt=prompt,
        constraints=constraints,
        keep_tokens=keep,
        parser=syntax.tool_parser,
        tools=tools,
        reasoning=syntax.reasoning,
        thinking_open=thinking_open,
        embeddings=spans,
    )


def _budgeted(
    service: ModelService, budget: int, opened: bool, inner: LogitsConstraint | None
) -> ThinkingBudget:
    """`inner` (the answer's grammar) behind a thinking budget."""
    encode = service.tokenizer.encode
    return ThinkingBudget(
        budget,
        start=encode(THINK_START, add_special_tokens=False),
        end=encode(THINK_END, add_special_tokens=False),
        close=encode(f"\n{THINK_END}\n\n", add_special_tokens=False),
        opened=opened,
        inner=inner,
    )


async def _constraint(
    service: ModelService, chat: ChatRequest, thinking_open: bool
) -> LogitsConstraint | None:
    """Compile the grammar off the event loop (a big schema takes a while)."""
    tok, vocab, family = service.tokenizer, service.engine.vocab_size, service.syntax.tool_parser
    if chat.tools.active:
        specials = {m: i for m in MARKERS if (i := tok.special_token_id(m)) is not None}
        try:
            lark = tool_grammar(family, chat.tools, specials, thinking_open)
        except NoGrammar:
            if chat.tools.forced:  # a promise only a grammar keeps
                raise invalid(
                    "tool_choice",
                    f"tool_choice {chat.tools.choice.mode.value!r} is not supported with the "
                    f"{family} call format; use 'auto'",
                ) from None
            return None  # this family/choice is parsed, not constrained (README)
        param = "tools"
        build = (build_lark_constraint, lark)
    elif chat.response_format is not None:
        param = "response_format"
        try:
            schema = schema_for(chat.response_format)
        except ConstraintError as exc:
            raise invalid(param, str(exc)) from None
        if thinking_open:
            build = (build_lark_constraint, answer_grammar(schema, True))
        else:
            build = (build_constraint, chat.response_format)
    else:
        return None
    try:
        return await asyncio.to_thread(build[0], build[1], tok, vocab)
    except ConstraintError as exc:
        tools = chat.tools
        if param == "tools" and not tools.forced and not any(t.strict for t in tools.tools):
            return None  # auto without strict: a schema llguidance cannot take is only parsed
        raise invalid(param, str(exc)) from None
