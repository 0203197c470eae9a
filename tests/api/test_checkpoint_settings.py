"""What the checkpoint says is honoured: generation_config.json's eos_token_id list stops
generation and its temperature/top_p are the defaults of requests that omit them; the chat
template comes from tokenizer_config.json or chat_template.jinja, and --chat-template replaces it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from llm_server.api.shared.schemas import parse_chat, parse_completion
from llm_server.generation_config import SamplingDefaults, load_sampling_defaults
from llm_server.testing.live import serving
from llm_server.testing.tiny import EOS_TOKEN

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hello"}]


def _copy(src: Path, dst: Path, generation_config: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return dst


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _greedy(srv, **extra):
    return _client(srv).completions.create(
        model=srv.state.model_id, prompt=PROMPT, max_tokens=10, logprobs=0, **extra
    )


def test_eos_token_id_list_stops_generation(tiny_model_path, tmp_path):
    with serving(tiny_model_path) as srv:
        tok = srv.service.tokenizer
        base = _greedy(srv, temperature=0).choices[0]
    tokens = base.logprobs.tokens
    # the first generated token (after two) that is one token on its own and new so far
    k = next(
        i
        for i in range(2, len(tokens))
        if len(tok.encode(tokens[i], add_special_tokens=False)) == 1 and tokens[i] not in tokens[:i]
    )
    stop_id = tok.encode(tokens[k], add_special_tokens=False)[0]
    eos_id = tok.hf.convert_tokens_to_ids(EOS_TOKEN)
    model = _copy(tiny_model_path, tmp_path / "m", {"eos_token_id": [eos_id, stop_id]})
    with serving(model) as srv:
        assert srv.service.tokenizer.eos_token_ids == {eos_id, stop_id}
        got = _greedy(srv, temperature=0).choices[0]
    assert got.logprobs.tokens == tokens[:k]
    assert got.text == "".join(tokens[:k]) and got.finish_reason == "stop"


def test_generation_config_defaults_apply_when_request_omits_them(tiny_model_path, tmp_path):
    # top_p so small only the most likely token survives: sampling at the default temperature
    # 1.0 then returns exactly the greedy answer, whatever the seed
    model = _copy(tiny_model_path, tmp_path / "m", {"top_p": 1e-6, "do_sample": True})
    with serving(model) as srv:
        assert srv.service.sampling_defaults == SamplingDefaults(temperature=1.0, top_p=1e-6)
        greedy = _greedy(srv, temperature=0).choices[0]
        for seed in (1, 2, 3):
            assert _greedy(srv, seed=seed).choices[0].text == greedy.text
        # a request that sets top_p gets its own (a full-vocabulary sample differs from greedy)
        sampled = {_greedy(srv, seed=s, top_p=1.0).choices[0].text for s in (1, 2, 3)}
        assert sampled != {greedy.text}


def test_load_sampling_defaults(tmp_path):
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]})
    )
    assert load_sampling_defaults(tmp_path) == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 7, "top_p": "x"}))
    assert load_sampling_defaults(tmp_path) == SamplingDefaults()  # out of range: ignored


def test_request_fields_override_the_defaults():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05)
    omitted = parse_chat({"messages": MESSAGES}, 16, defaults=defaults).params
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p) == (
        0.6,
        0.95,
        20,
        0.05,
    )
    assert parse_chat({"messages": MESSAGES, "top_k": 0}, 16, defaults=defaults).params.top_k == 0
    null = parse_completion({"prompt": "x", "temperature": None}, 16, 100, defaults=defaults).params
    assert (null.temperature, null.top_p) == (0.6, 0.95)
    given = parse_chat(
        {"messages": MESSAGES, "temperature": 0, "top_p": 0.5}, 16, defaults=defaults
    )
    assert (given.params.temperature, given.params.top_p) == (0.0, 0.5)
    plain = parse_chat({"messages": MESSAGES}, 16).params  # no generation_config: OpenAI's
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)


JINJA = (
    "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja", "flag"])
def test_chat_template_source(tiny_model_path, tmp_path, where):
    model = _copy(tiny_model_path, tmp_path / "m")
    override = None
    if where == "chat_template.jinja":
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
        (model / "chat_template.jinja").write_text(JINJA)
    elif where == "flag":
        override = JINJA  # --chat-template FILE, read by the CLI
    with serving(model, chat_template=override) as srv:
        tok = srv.service.tokenizer
        ids = tok.apply_chat_template(MESSAGES)
        reply = _client(srv).chat.completions.create(
            model=srv.state.model_id, messages=MESSAGES, max_tokens=2, temperature=0
        )
    text = tok.decode(ids, skip_special_tokens=False)
    if where == "tokenizer_config.json":
        assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert text == "<<user>>Hello<<assistant>>"
    assert reply.usage.prompt_tokens == len(ids)


def test_chat_template_flag_reads_the_file(tmp_path):
    from llm_server.cli import build_parser

    f = tmp_path / "t.jinja"
    f.write_text(JINJA)
    assert build_parser().parse_args(["--chat-template", str(f)]).chat_template == JINJA
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--chat-template", str(tmp_path / "missing.jinja")])
