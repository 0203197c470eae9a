"""What a chat request asks about tools and reasoning, as plain frozen data (validated by the API)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class ChoiceMode(enum.Enum):
    NONE = "none"  # never call: no grammar, no parsing (the template still sees the tools)
    AUTO = "auto"  # the model decides; a call it starts is held to its schema (lazy grammar)
    REQUIRED = "required"  # at least one call, valid by construction
    NAMED = "named"  # exactly the named function, valid by construction


@dataclass(frozen=True)
class ToolSpec:
    """One `tools[i]` entry of type function."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # JSON schema of the arguments object
    strict: bool = False

    def template_dict(self) -> dict[str, Any]:
        """The OpenAI shape chat templates expect (`{"type": "function", "function": {...}}`)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None  # the function when mode is NAMED


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one chat request; `tools` is empty when the request sent none."""

    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = field(default_factory=lambda: ToolChoice(ChoiceMode.AUTO))
    parallel: bool = True

    @property
    def active(self) -> bool:
        """True when output must be parsed for calls."""
        return bool(self.tools) and self.choice.mode != ChoiceMode.NONE

    @property
    def forced(self) -> bool:
        """True when the whole answer is calls (required or named)."""
        return self.active and self.choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED)

    def callable(self) -> tuple[ToolSpec, ...]:
        """The functions the model may call under the tool choice."""
        if self.choice.mode == ChoiceMode.NAMED:
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools

    def find(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)
