"""Which tool-call syntax and reasoning markers a served model uses, read from its chat template."""

from __future__ import annotations

from dataclasses import dataclass

from llm_server.tools.generic import NAME as GENERIC
from llm_server.tools.reasoning import THINK_END, THINK_START
from llm_server.tools.registry import PARSERS


class UnknownParser(ValueError):
    """--tool-parser names no known parser."""


@dataclass(frozen=True)
class ModelSyntax:
    """What the model's template and tokenizer say about tool calls and thinking."""

    tool_parser: str  # a PARSERS key; "generic" when the template shows no call syntax
    reasoning: str | None  # "think" (<think>...</think>), "harmony" (analysis channel) or None

    @property
    def thinks(self) -> bool:
        return self.reasoning is not None


def detect_parser(template: str, vocab: dict[str, int]) -> str | None:
    """The parser for the call syntax the chat template teaches, or None."""
    if "<|channel|>" in template:
        return "harmony"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument' in template:
        return "llama3_json"
    return None


def model_syntax(template: str, vocab: dict[str, int], override: str | None) -> ModelSyntax:
    """Detect the family; `override` (--tool-parser) wins; the generic format where the
    template shows no call syntax. UnknownParser for a bad name."""
    if override is not None and override not in PARSERS:
        raise UnknownParser(
            f"unknown tool parser {override!r}; choose one of {', '.join(sorted(PARSERS))}"
        )
    parser = override or detect_parser(template, vocab) or GENERIC
    reasoning = None
    if "<|channel|>" in template:
        reasoning = "harmony"
    elif THINK_END in template or (THINK_START in vocab and THINK_END in vocab):
        reasoning = "think"
    return ModelSyntax(parser, reasoning)
