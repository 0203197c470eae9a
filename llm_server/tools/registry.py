"""Every tool-call parser by the name `--tool-parser` takes."""

from __future__ import annotations

from llm_server.tools.generic import GenericParser
from llm_server.tools.harmony import HarmonyParser
from llm_server.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    Qwen3CoderParser,
    ToolParser,
)

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Qwen3CoderParser,
        Llama3JsonParser,
        MistralParser,
        HarmonyParser,
        GenericParser,
    )
}
