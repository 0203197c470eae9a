"""A call ends when its grammar says so: on a checkpoint whose generation_config.json lists
text tokens as EOS ids, a forced call's grammar takes them as text until it accepts; stop
sequences wait for it too; a token limit cuts it as `length`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_server.decoding import Decoder, FinishReason, SamplingParams
from llm_server.testing.tiny import HERMES_TEMPLATE, build_tiny_checkpoint
from llm_server.tokenizer import Tokenizer
from llm_server.tools.constrained import build_lark_constraint
from llm_server.tools.grammar import tool_grammar
from llm_server.tools.output import ChatOutput
from llm_server.tools.registry import PARSERS
from llm_server.tools.spec import ChoiceMode, ToolChoice, ToolRequest, ToolSpec

# the text tokens a checkpoint lists as EOS besides its special ones (what cut a real call)
EOS_TEXT = ['"', ",", "}", ":"]
CITY = ToolSpec(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
FORCED = ToolRequest((CITY,), ToolChoice(ChoiceMode.REQUIRED), parallel=False)


def write_eos_list(path: Path, tok_json: Path) -> list[int]:
    """List the special EOS-like tokens and EOS_TEXT as eos_token_id in generation_config.json."""
    vocab = json.loads(tok_json.read_text())["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads(tok_json.read_text())["added_tokens"]}
    ids = [added["<|im_end|>"], added["<|endoftext|>"], *(vocab[t] for t in EOS_TEXT)]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return ids


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp("eos") / "tiny-eos", chat_template=HERMES_TEMPLATE
    )
    write_eos_list(path, path / "tokenizer.json")
    return Tokenizer(path)


def _decode(
    tok: Tokenizer,
    req: ToolRequest,
    favoured: list[int],
    max_tokens: int = 200,
    stop: tuple[str, ...] = (),
):
    """Greedy decoding under `req`'s grammar with logits that rank `favoured` first."""
    constraint = build_lark_constraint(tool_grammar("hermes", req, {}, False), tok, tok.vocab_size)
    dec = Decoder(
        SamplingParams(max_tokens, temperature=0.0, stop=stop),
        tok.eos_token_ids,
        tok.decoder_keeping(frozenset()),
        constraint,
    )
    logits = np.zeros(tok.vocab_size, dtype=np.float32)
    logits[favoured] = 10.0
    text = ""
    for _ in range(max_tokens):
        out = dec.step(logits, room=1000)
        text += out.text
        if out.finish is not None:
            return text, out.finish
    raise AssertionError("the decoder never finished")


def test_the_checkpoint_lists_text_tokens_as_eos(tok):
    ids = {tok.encode(t, False)[0] for t in EOS_TEXT}
    assert ids <= tok.eos_token_ids and len(tok.eos_token_ids) == len(EOS_TEXT) + 2


def test_eos_ids_inside_a_forced_call_are_text(tok):
    """Every listed EOS id is the most likely token at every step; the call still completes."""
    text, finish = _decode(tok, FORCED, sorted(tok.eos_token_ids))
    assert finish == FinishReason.STOP
    out = ChatOutput(PARSERS["hermes"]((CITY,)), None, 1)
    out.feed(text)
    out.finish()
    assert out.called, text
    args = json.loads(out.calls[0]["function"]["arguments"])
    assert set(args) == {"city", "days"} and isinstance(args["days"], int)


def test_an_eos_id_ends_where_the_grammar_accepts(tok):
    """Under auto, text before any call is a whole answer: the favoured `"` (an EOS id) ends it
    at once, as an EOS does without a grammar."""
    auto = ToolRequest((CITY,), ToolChoice(ChoiceMode.AUTO))
    text, finish = _decode(tok, auto, [tok.encode('"', False)[0]])
    assert (text, finish) == ("", FinishReason.STOP)


def test_the_limit_cuts_a_forced_call_as_length(tok):
    text, finish = _decode(tok, FORCED, sorted(tok.eos_token_ids), max_tokens=12)
    assert finish == FinishReason.LENGTH
    out = ChatOutput(PARSERS["hermes"]((CITY,)), None, 1)
    out.feed(text)
    out.finish(cut=True)
    assert out.open_call and not out.called and out.content == ""


def test_stop_sequences_wait_for_the_grammar(tok):
    """A stop sequence inside a forced call does not cut it; before any call (auto) it does."""
    stop = ('"', ",", "}", "<tool")
    text, finish = _decode(tok, FORCED, sorted(tok.eos_token_ids), stop=stop)
    assert finish == FinishReason.STOP
    out = ChatOutput(PARSERS["hermes"]((CITY,)), None, 1)
    out.feed(text)
    out.finish()
    assert out.called and text.endswith("</tool_call>"), text
    auto = ToolRequest((CITY,), ToolChoice(ChoiceMode.AUTO))
    first = tok.encode("Hello", False)[0]
    text, finish = _decode(tok, auto, [first], stop=(tok.decode([first]),))
    assert (text, finish) == ("", FinishReason.STOP)
