"""The llguidance tool grammars: each family's forced and lazy grammar accepts a valid call and
rejects arguments that break the schema (on the tiny checkpoint's real BPE tokenizer)."""

from __future__ import annotations

import pytest

from llm_server.tokenizer import Tokenizer
from llm_server.tools.constrained import build_lark_constraint
from llm_server.tools.grammar import answer_grammar, tool_grammar
from llm_server.tools.spec import ChoiceMode, ToolChoice, ToolRequest, ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
REQUIRED = ToolRequest((WEATHER,), ToolChoice(ChoiceMode.REQUIRED))
AUTO = ToolRequest((WEATHER,), ToolChoice(ChoiceMode.AUTO))

VALID = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    "\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
}


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def _accepts(tok: Tokenizer, lark: str, text: str) -> bool:
    c = build_lark_constraint(lark, tok, tok.vocab_size)
    for t in tok.encode(text, add_special_tokens=False):
        try:
            c.advance(t)
        except RuntimeError:
            return False
    return c.matcher.is_accepting()


@pytest.mark.parametrize("family", sorted(VALID))
def test_forced_grammar_holds_calls_to_the_schema(tok, family):
    lark = tool_grammar(family, REQUIRED, {}, thinking_open=False)
    assert _accepts(tok, lark, VALID[family])
    assert not _accepts(tok, lark, VALID[family].replace("2", '"two"', 1))
    assert not _accepts(tok, lark, "Sure, the weather is fine.")


@pytest.mark.parametrize("family", ["hermes", "qwen3_coder", "mistral", "llama3_json"])
def test_lazy_grammar_frees_text_until_the_marker(tok, family):
    lark = tool_grammar(family, AUTO, {}, thinking_open=False)
    if family == "llama3_json":  # the call is the whole answer
        assert _accepts(tok, lark, VALID[family]) and _accepts(tok, lark, "No call needed.")
        assert not _accepts(tok, lark, VALID[family].replace("2", '"two"', 1))
        assert _accepts(tok, lark, "\n" + VALID[family]) and _accepts(tok, lark, " Hi {x}")
        return
    assert _accepts(tok, lark, "Let me look. " + VALID[family])
    assert _accepts(tok, lark, "No call needed.")
    assert not _accepts(tok, lark, "Let me look. " + VALID[family].replace("2", '"two"', 1))
    if family != "mistral":  # Mistral's parallel calls share one array
        assert _accepts(tok, lark, "Let me look. " + VALID[family] + "\n" + VALID[family])
    assert not _accepts(tok, lark, "Let me look. " + VALID[family] + " Done.")


def _accepts_ids(tok: Tokenizer, lark: str, ids: list[int]) -> bool:
    c = build_lark_constraint(lark, tok, tok.vocab_size)
    for t in ids:
        try:
            c.advance(t)
        except RuntimeError:
            return False
    return c.matcher.is_accepting()


@pytest.mark.parametrize("forced", [True, False])
def test_mistral_v11_grammar_names_the_special_tokens(tok, forced):
    # stand-ins: two special tokens of the tiny vocabulary play [TOOL_CALLS] and [ARGS]
    tc, args = tok.special_token_id("<|im_start|>"), tok.special_token_id("<|endoftext|>")
    specials = {"[TOOL_CALLS]": tc, "[ARGS]": args}
    lark = tool_grammar("mistral", REQUIRED if forced else AUTO, specials, thinking_open=False)
    call = [tc, *tok.encode("get_weather", False), args]
    good = call + tok.encode('{"city": "Paris", "days": 2}', False)
    bad = call + tok.encode('{"city": "Paris", "days": "2"}', False)
    prefix = [] if forced else tok.encode("Let me look. ", False)
    assert _accepts_ids(tok, lark, prefix + good + good)
    assert not _accepts_ids(tok, lark, prefix + bad)


def test_grammar_applies_after_thinking(tok):
    lark = tool_grammar("hermes", REQUIRED, {}, thinking_open=True)
    assert _accepts(tok, lark, "I need the weather.</think>\n\n" + VALID["hermes"])
    assert not _accepts(tok, lark, "I need the weather.</think>\n\nIt is sunny.")
    fmt = answer_grammar({"type": "object", "required": ["a"]}, thinking_open=True)
    assert _accepts(tok, fmt, 'hmm</think>\n{"a": 1}')
    assert not _accepts(tok, fmt, "hmm</think>\nplain")


def test_decoder_keeps_only_the_marker_special_tokens(tok):
    marker, other = tok.special_token_id("<|im_start|>"), tok.special_token_id("<|endoftext|>")
    ids = [marker, *tok.encode("hi", False), other]
    assert tok.decoder_keeping(frozenset({marker}))(ids) == "<|im_start|>hi"
    assert tok.decoder_keeping(frozenset())(ids) == "hi"
