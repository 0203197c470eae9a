"""The generic tool format (templates without call syntax): detection, the prompt it shows, the
calls it parses from written text, and an answer a token limit cut inside a call."""

from __future__ import annotations

import json

from llm_server.testing.tiny import CHATML_TEMPLATE, HERMES_TEMPLATE
from llm_server.tools.detect import model_syntax
from llm_server.tools.generic import generic_messages, tools_block
from llm_server.tools.output import ChatOutput
from llm_server.tools.registry import PARSERS
from llm_server.tools.spec import ChoiceMode, ToolChoice, ToolRequest, ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    "Weather for a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = ToolSpec("get_time", None, {"type": "object", "properties": {}})
AUTO = ToolRequest((WEATHER, TIME))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _output(parallel: bool = True) -> ChatOutput:
    return ChatOutput(PARSERS["generic"]((WEATHER, TIME)), None, None if parallel else 1)


def test_a_template_without_call_syntax_gets_the_generic_format():
    assert model_syntax(CHATML_TEMPLATE, {}, None).tool_parser == "generic"
    assert model_syntax(HERMES_TEMPLATE, {}, None).tool_parser == "hermes"  # family first
    assert model_syntax(HERMES_TEMPLATE, {}, "generic").tool_parser == "generic"  # override
    assert model_syntax(CHATML_TEMPLATE, {}, "hermes").tool_parser == "hermes"


def test_the_tools_block_joins_the_system_message():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]
    out = generic_messages(msgs, AUTO)
    assert [m["role"] for m in out] == ["system", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    shown = [
        json.loads(line)
        for line in system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    ]
    assert shown == [WEATHER.template_dict(), TIME.template_dict()]
    assert '<tool_call>\n{"name": "<function-name>"' in system
    # no system message: one is put first; as the first user turn for templates without one
    alone = generic_messages(msgs[1:], AUTO)
    assert alone[0] == {"role": "system", "content": tools_block(AUTO)}
    into_user = generic_messages(msgs[1:], AUTO, into_user=True)
    assert into_user == [{"role": "user", "content": tools_block(AUTO) + "\n\nParis?"}]


def test_named_and_required_blocks_show_what_to_call():
    named = ToolRequest((WEATHER, TIME), ToolChoice(ChoiceMode.NAMED, "get_time"))
    block = tools_block(named)
    assert '"get_time"' in block and '"get_weather"' not in block
    assert block.endswith("Call the function 'get_time' now.")
    assert tools_block(ToolRequest((WEATHER,), ToolChoice(ChoiceMode.REQUIRED))).endswith(
        "Call at least one function now."
    )
    none = ToolRequest((WEATHER,), ToolChoice(ChoiceMode.NONE))
    assert generic_messages([{"role": "user", "content": "hi"}], none) == [
        {"role": "user", "content": "hi"}
    ]


def test_history_calls_and_results_become_text():
    msgs = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]
    out = generic_messages(msgs, ToolRequest((WEATHER,), ToolChoice(ChoiceMode.NONE)))
    assert out == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": "<tool_response>\nsunny\n</tool_response>\n"
            "<tool_response>\nnoon\n</tool_response>",
        },
    ]


def test_auto_parses_a_call_the_model_writes():
    out = _output()
    deltas = [
        d for piece in ["Let me check.\n<tool", "_call>\n", CALL[12:]] for d in out.feed(piece)
    ]
    deltas += out.finish()
    assert out.content == "Let me check.\n"
    assert all("<" not in d.get("content", "") for d in deltas)  # no markup streamed as content
    assert out.called and out.finish_reason("stop") == "tool_calls"
    (call,) = out.message()["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_plain_text_stays_content():
    out = _output()
    out.feed("Paris is sunny today.")
    out.finish()
    assert out.message() == {"role": "assistant", "content": "Paris is sunny today."}
    assert out.finish_reason("stop") == "stop"


def test_a_call_cut_by_the_limit_is_partial_and_never_content():
    out = _output()
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    streamed = out.feed(cut) + out.finish(cut=True)
    assert out.open_call and not out.called
    assert out.finish_reason("length") == "length"
    assert all("content" not in d for d in streamed)
    msg = out.message()
    assert msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}


def test_a_cut_inside_the_markup_leaks_nothing():
    for cut in ("Sure.\n<tool_c", 'Sure.\n<tool_call>\n{"na'):
        out = _output()
        out.feed(cut)
        out.finish(cut=True)
        assert out.content == "Sure.\n" and out.calls == [] and not out.called
        assert out.message() == {"role": "assistant", "content": "Sure.\n"}


def test_a_cut_after_whole_calls_keeps_them():
    out = _output()
    out.feed(CALL)
    out.finish(cut=True)
    assert out.called and not out.open_call
    assert out.finish_reason("length") == "tool_calls"


def test_a_malformed_call_the_model_ended_is_text():
    """EOS after broken JSON (no grammar held it): the whole answer is content, as before."""
    out = _output()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    out.feed(text)
    out.finish()
    assert out.error and not out.called and out.content == text


# Gemma-style: no system turn, user/assistant must alternate
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<turn>{{ m.role }}\n{{ m.content }}</turn>\n{% endfor %}<turn>model\n"
)


def test_a_template_without_a_system_turn_gets_the_tools_in_the_first_user_turn(tiny_model_path):
    from types import SimpleNamespace

    from llm_server.api.chat.plan import render_prompt
    from llm_server.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_path, chat_template=NO_SYSTEM_TEMPLATE)
    syntax = model_syntax(tok.template_source, {}, None)
    assert syntax.tool_parser == "generic"
    service = SimpleNamespace(tokenizer=tok, syntax=syntax)
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny"},
    ]
    text = tok.decode(render_prompt(service, history, AUTO), skip_special_tokens=False)
    assert text.startswith("<turn>user\n# Tools\n") and "\n\nWeather?</turn>" in text
    assert f"<turn>assistant\n{CALL}</turn>" in text
    assert "<turn>user\n<tool_response>\nsunny\n</tool_response></turn>" in text
