"""Constrained decoding (`response_format`): llguidance masks, schemas on the real SmolLM2, modes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from llm_server.decoding import FinishReason, SamplingParams
from llm_server.tokenizer import Tokenizer
from llm_server.tools.constrained import (
    ConstraintError,
    JsonConstraint,
    build_constraint,
    ll_tokenizer,
)

SCHEMA_DIR = Path(__file__).parent / "data" / "schemas"
# (prompt, schema): required fields, enums, bounded integers, arrays, nested objects. Strings carry
# maxLength so every answer fits SCHEMA_MAX_TOKENS.
SCHEMAS: list[tuple[str, dict]] = [
    (case["prompt"], case["schema"])
    for case in (json.loads(f.read_text()) for f in sorted(SCHEMA_DIR.glob("*.json")))
]
UNSATISFIABLE = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}},
    "required": ["n"],
}

PLAIN_PROMPTS = ["What is the capital of France?", "Name three colours."]
SCHEMA_MAX_TOKENS = 80
PLAIN_MAX_TOKENS = 24


def _schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


async def _collect(handle) -> tuple[list[int], str, FinishReason]:
    ids, text = [], ""
    async for ev in handle.events():
        if handle.finish is None:
            text += ev.text
            ids.append(ev.token_id)
    return ids, text, handle.finish.reason


def _start(svc, content: str, max_tokens: int, response_format: dict | None = None):
    prompt = svc.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    constraint = None
    if response_format is not None:
        constraint = build_constraint(response_format, svc.tokenizer, svc.engine.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return svc.start_generation(prompt, params, constraint)


# -- the matcher on its own (tiny model's tokenizer) ---------------------------------------------


def _feed(constraint: JsonConstraint, tok: Tokenizer, text: str) -> bool:
    done = False
    for t in tok.encode(text, add_special_tokens=False):
        logits = constraint.mask(np.zeros(constraint.vocab_size, dtype=np.float32))
        assert np.isfinite(logits[t]), f"token {t} of {text!r} was masked"
        done = constraint.advance(t)
    return done


def test_eos_is_allowed_exactly_when_the_grammar_is_complete(tiny_tokenizer):
    tok = tiny_tokenizer
    eos = min(tok.eos_token_ids)
    fmt = _schema_format({"type": "integer", "minimum": 0, "maximum": 999})
    c = build_constraint(fmt, tok, tok.vocab_size)
    assert c.mask(np.zeros(tok.vocab_size, dtype=np.float32))[eos] == -np.inf
    assert not _feed(c, tok, "12")
    assert np.isfinite(c.mask(np.zeros(tok.vocab_size, dtype=np.float32))[eos])
    assert c.advance(eos)  # EOS ends a complete value


def test_closing_brace_completes_an_object_and_masks_the_rest(tiny_tokenizer):
    tok = tiny_tokenizer
    c = build_constraint({"type": "json_object"}, tok, tok.vocab_size)
    first = c.mask(np.zeros(tok.vocab_size, dtype=np.float32))
    allowed = {tok.decode([int(i)]) for i in np.flatnonzero(np.isfinite(first))}
    assert allowed and all(s.startswith("{") for s in allowed)
    assert _feed(c, tok, '{"a": [1, 2]}')  # stopped: finish_reason "stop" without EOS


def test_mask_leaves_the_engine_logits_untouched(tiny_tokenizer):
    tok = tiny_tokenizer
    c = build_constraint({"type": "json_object"}, tok, tok.vocab_size)
    logits = np.arange(tok.vocab_size, dtype=np.float32)
    logits.flags.writeable = False  # engine rows may be read-only views
    masked = c.mask(logits)
    assert masked.shape == logits.shape and masked.dtype == np.float32
    keep = np.isfinite(masked)
    assert np.array_equal(masked[keep], logits[keep])


def test_llguidance_tokenizer_is_built_once_per_tokenizer(tiny_tokenizer):
    a = ll_tokenizer(tiny_tokenizer, tiny_tokenizer.vocab_size)
    assert ll_tokenizer(tiny_tokenizer, tiny_tokenizer.vocab_size) is a
    hf = ll_tokenizer(tiny_tokenizer.hf, tiny_tokenizer.vocab_size)  # EOS from the HF tokenizer
    assert ll_tokenizer(tiny_tokenizer.hf, tiny_tokenizer.vocab_size) is hf


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        (
            _schema_format({"type": "integer", "minimum": 5, "maximum": 2}),
            "minimum (5) is greater than maximum (2)",
        ),
        (
            _schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}),
            "Invalid type: strin",
        ),
        (_schema_format({"$ref": "#/definitions/missing"}), "/definitions/missing"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "grammar"}, "'grammar' is not supported"),
        ("json", "response_format must be an object"),
    ],
)
def test_bad_response_format_raises_constraint_error(tiny_tokenizer, response_format, message):
    with pytest.raises(ConstraintError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_constraint(response_format, tiny_tokenizer, tiny_tokenizer.vocab_size)


# -- the real SmolLM2 default ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["batched", "exclusive"])
def smol_service(request, default_model_path):
    from llm_server.testing.live import tiny_service

    svc = tiny_service(default_model_path, 4, constrained_mode=request.param)
    yield svc
    svc.scheduler.abort()
    svc.close(30)


@pytest.mark.slow
def test_schemas_validate_in_the_batch_and_plain_rows_are_unchanged(smol_service):
    svc = smol_service
    exclusive = svc.config.constrained_mode == "exclusive"

    async def run():
        alone = [await _collect(_start(svc, p, PLAIN_MAX_TOKENS)) for p in PLAIN_PROMPTS]
        schema_handles = [
            _start(svc, prompt, SCHEMA_MAX_TOKENS, _schema_format(schema, f"s{i}"))
            for i, (prompt, schema) in enumerate(SCHEMAS)
        ]
        plain_handles = [_start(svc, p, PLAIN_MAX_TOKENS) for p in PLAIN_PROMPTS]
        handles = schema_handles + plain_handles
        done = await asyncio.wait_for(asyncio.gather(*(_collect(h) for h in handles)), 150)
        return alone, handles, done

    alone, handles, done = asyncio.run(run())
    schema_results, plain_results = done[: len(SCHEMAS)], done[len(SCHEMAS) :]
    schema_handles = handles[: len(SCHEMAS)]
    for (prompt, schema), (_, text, reason), h in zip(
        SCHEMAS, schema_results, schema_handles, strict=True
    ):
        assert reason is FinishReason.STOP, f"{prompt!r} stopped by {reason}: {text!r}"
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert h.request.exclusive is exclusive
    assert [r[0] for r in plain_results] == [r[0] for r in alone]
    assert [r[1] for r in plain_results] == [r[1] for r in alone]
    if not exclusive:  # constrained rows shared the batch with the plain ones
        assert svc.scheduler.max_rows_busy == 4
    assert svc.scheduler.idle()


@pytest.mark.slow
def test_json_object_mode_gives_a_json_object(default_model_path, make_service):
    svc = make_service(default_model_path, 2)
    prompt = 'Reply with a JSON object with the keys "city" and "country" for Paris.'

    async def run():
        return await _collect(_start(svc, prompt, 64, {"type": "json_object"}))

    _, text, reason = asyncio.run(run())
    assert reason is FinishReason.STOP, text
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_invalid_schema_is_refused_before_anything_runs(default_model_path, make_service):
    svc = make_service(default_model_path, 2)
    bad = _schema_format(UNSATISFIABLE)

    async def run():
        with pytest.raises(ConstraintError, match="required property 'n' is unsatisfiable"):
            _start(svc, "Give me a number.", 16, bad)
        return await _collect(_start(svc, "Say hi.", 4))  # the service still serves

    _, _, reason = asyncio.run(run())
    assert reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert svc.scheduler.idle()
    stats = svc.scheduler.stats()
    assert stats.rows_busy == 0 and stats.queued == 0


# -- over HTTP ------------------------------------------------------------------------------------


def _chat_body(content: str, response_format: dict, **extra) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": SCHEMA_MAX_TOKENS,
        "response_format": response_format,
        **extra,
    }


def _stream_text(client, body: dict) -> tuple[str, str | None]:
    text, reason = "", None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                text += choice["delta"].get("content") or ""
                reason = choice.get("finish_reason") or reason
    return text, reason


@pytest.mark.slow
def test_http_response_format_streaming_and_not(default_model_path, live_server):
    import httpx

    srv = live_server(default_model_path, 2)
    prompt, schema = SCHEMAS[2]
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        resp = client.post("/v1/chat/completions", json=_chat_body(prompt, _schema_format(schema)))
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)

        text, reason = _stream_text(client, _chat_body(prompt, _schema_format(schema)))
        assert reason == "stop"
        assert text == choice["message"]["content"]

        body = _chat_body(
            'Reply with a JSON object with the keys "city" and "country" for Paris.',
            {"type": "json_object"},
        )
        text, reason = _stream_text(client, body)
        assert reason == "stop" and isinstance(json.loads(text), dict)

        short = client.post(
            "/v1/chat/completions",
            json={**_chat_body(prompt, _schema_format(schema)), "max_tokens": 3},
        )
        assert short.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_http_bad_response_format_is_a_400_and_nothing_runs(default_model_path, live_server):
    import httpx

    srv = live_server(default_model_path, 2)
    cases = [
        (_schema_format(UNSATISFIABLE), "required property 'n' is unsatisfiable"),
        (
            _schema_format({"type": "object", "properties": {"a": {"type": "strin"}}}),
            "Invalid type: strin",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
        ({"type": "yaml"}, "response_format.type"),
    ]
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        for response_format, message in cases:
            for stream in (False, True):
                body = _chat_body("Give me a number.", response_format, stream=stream)
                resp = client.post("/v1/chat/completions", json=body)
                assert resp.status_code == 400, resp.text
                error = resp.json()["error"]
                assert message in error["message"]
                assert error["param"].startswith("response_format")
    stats = srv.service.scheduler.stats()
    assert srv.service.scheduler.idle() and stats.decode_steps == 0 and stats.rows_busy == 0


def test_constrained_mode_flag_defaults_to_batched():
    from llm_server.cli import build_parser

    assert build_parser().parse_args([]).constrained_mode == "batched"
    parse = build_parser().parse_args
    assert parse(["--constrained-mode", "exclusive"]).constrained_mode == "exclusive"
    assert parse(["--constrained-mode", "lease"]).constrained_mode == "exclusive"  # the old name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--constrained-mode", "alone"])
