"""Tool-call parsers per family on recorded model output: clean, parallel, malformed, streamed."""

from __future__ import annotations

import json

import pytest

from llm_server.tools.detect import detect_parser
from llm_server.tools.output import ChatOutput
from llm_server.tools.parsers import ParsedCall
from llm_server.tools.reasoning import ReasoningSplitter, prompt_opens_thinking
from llm_server.tools.registry import PARSERS
from llm_server.tools.spec import ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)

# family -> (clean, parallel, malformed) as recorded from Qwen2.5, Qwen3-Coder, Llama 3.1, Mistral
SAMPLES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
    ),
    "qwen3_coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>",
    ),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"',
    ),
    "mistral": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"',
    ),
    "mistral_v11": (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 1}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"',
    ),
}
CLEAN = [ParsedCall("get_weather", '{"city": "Paris", "days": 2}', True)]
PARALLEL = [
    ParsedCall("get_weather", '{"city": "Paris"}', True),
    ParsedCall("get_weather", '{"city": "Rome", "days": 1}', True),
]
CLEAN_CONTENT = {"hermes": "Let me check.\n", "qwen3_coder": "Let me check.\n"}


def _parser(family: str):
    return PARSERS[family.removesuffix("_v11")]([WEATHER])


def _streamed(family: str, text: str) -> ChatOutput:
    """Feed `text` one character at a time; every snapshot must only grow."""
    out = ChatOutput(_parser(family), None)
    content, calls = "", {}
    for ch in text:
        for delta in out.feed(ch):
            content += delta.get("content", "")
            for tc in delta.get("tool_calls", ()):
                entry = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:
                    assert entry["name"] is None and tc["id"].startswith("call_")
                    entry["name"] = tc["function"]["name"]
                entry["arguments"] += tc["function"]["arguments"]
    for delta in out.finish():
        content += delta.get("content", "")
        assert "tool_calls" not in delta or out.error is None
    if out.called:
        assert content == out.content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in out.calls
        ]
    return out


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_clean_call(family):
    text = SAMPLES[family][0]
    result = _parser(family).parse(text, final=True)
    assert list(result.calls) == CLEAN and result.error is None
    assert result.content == CLEAN_CONTENT.get(family, "")
    out = _streamed(family, text)
    assert out.called and out.finish_reason("stop") == "tool_calls"
    assert json.loads(out.calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    msg = out.message()
    assert msg["content"] == CLEAN_CONTENT.get(family)


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_two_parallel_calls(family):
    result = _parser(family).parse(SAMPLES[family][1], final=True)
    assert list(result.calls) == PARALLEL and result.error is None
    out = _streamed(family, SAMPLES[family][1])
    assert [c["function"]["arguments"] for c in out.calls] == [c.arguments for c in PARALLEL]
    assert len({c["id"] for c in out.calls}) == 2


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_malformed_call_is_text(family):
    text = SAMPLES[family][2]
    assert _parser(family).parse(text, final=True).error is not None
    out = _streamed(family, text)
    assert not out.called and out.finish_reason("stop") == "stop"
    msg = out.message()
    assert msg["content"] == text and "tool_calls" not in msg


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_plain_text_passes_through(family):
    text = "The weather in Paris is mild."
    out = _streamed(family, text)
    assert out.message() == {"role": "assistant", "content": text}
    assert out.finish_reason("length") == "length"


def test_hermes_holds_back_a_forming_marker():
    parser = PARSERS["hermes"]([WEATHER])
    assert parser.parse("Sure <tool_").content == "Sure "
    assert parser.parse("Sure <tool_", final=True).content == "Sure <tool_"


def test_qwen3_coder_types_values_by_schema():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = PARSERS["qwen3_coder"]([WEATHER]).parse(text, final=True).calls
    assert json.loads(call.arguments) == {"city": "42", "days": 3}


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ('... <tool_call>\\n{"name": ...} </tool_call> ...', "hermes"),
        ("<tool_call>\\n<function=example>\\n<parameter=p>\\n...", "qwen3_coder"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
        ("{{- '<|start|>assistant<|channel|>analysis<|message|>' }}", "harmony"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    ],
)
def test_detect_family_from_template(template, family):
    assert detect_parser(template, {}) == family


def test_reasoning_split_streams_and_counts_tokens():
    out = ChatOutput(None, ReasoningSplitter(opened=True))
    pieces = ["The user", " greets.\n", "</thi", "nk>\n\n", "Hello", "!"]
    reasoning, content = "", ""
    for p in pieces:
        for d in out.feed(p):
            assert d.get("reasoning_content") == d.get("reasoning")
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content", "")
    for d in out.finish():
        content += d.get("content", "")
    assert (reasoning, content) == ("The user greets.", "Hello!")
    assert out.reasoning_tokens == 4  # through the token that closes </think>
    msg = out.message()
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == (
        "The user greets.",
        "The user greets.",
        "Hello!",
    )


def test_reasoning_opened_by_the_model_or_not_at_all():
    assert ReasoningSplitter(False).split("<think>hm</think> Hi", True).answer == "Hi"
    assert ReasoningSplitter(False).split("<think>hm</think> Hi", True).reasoning == "hm"
    assert ReasoningSplitter(False).split("Hi", True).reasoning == ""
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_parallel_tool_calls_false_keeps_the_first_call():
    out = ChatOutput(PARSERS["hermes"]([WEATHER]), None, max_calls=1)
    out.feed(SAMPLES["hermes"][1])
    out.finish()
    assert [c["function"]["arguments"] for c in out.message()["tool_calls"]] == [
        PARALLEL[0].arguments
    ]


HARMONY_THOUGHT = "<|channel|>analysis<|message|>Need the weather.<|end|>"
HARMONY = {
    "clean": HARMONY_THOUGHT + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
    '<|constrain|>json<|message|>{"city": "Paris", "days": 2}',
    "parallel": HARMONY_THOUGHT + "<|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|end|>'
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"city": "Rome", "days": 1}',
    "final": HARMONY_THOUGHT + "<|start|>assistant<|channel|>final<|message|>It is sunny.",
    "malformed": HARMONY_THOUGHT + "<|start|>assistant<|channel|>commentary "
    'to=functions.get_weather<|message|>{"city": ',
}


def _harmony(text: str) -> tuple[ChatOutput, str, str]:
    from llm_server.tools.harmony import HarmonyParser, HarmonySplitter

    out = ChatOutput(HarmonyParser([WEATHER]), HarmonySplitter())
    reasoning = content = ""
    for ch in text:
        for d in out.feed(ch):
            reasoning += d.get("reasoning_content") or ""
            content += d.get("content") or ""
    for d in out.finish():
        content += d.get("content") or ""
    return out, reasoning, content


def test_harmony_channels():
    out, reasoning, content = _harmony(HARMONY["clean"])
    assert reasoning == "Need the weather." and content == ""
    assert [c["function"] for c in out.message()["tool_calls"]] == [
        {"name": "get_weather", "arguments": CLEAN[0].arguments}
    ]
    out, _, _ = _harmony(HARMONY["parallel"])
    assert [c["function"]["arguments"] for c in out.calls] == [c.arguments for c in PARALLEL]
    out, reasoning, content = _harmony(HARMONY["final"])
    assert (reasoning, content, out.finish_reason("stop")) == (
        "Need the weather.",
        "It is sunny.",
        "stop",
    )
    out, _, content = _harmony(HARMONY["malformed"])
    assert not out.called and out.message()["content"].endswith('<|message|>{"city": ')
