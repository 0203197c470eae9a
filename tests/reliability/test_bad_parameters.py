"""The bad-input catalogue, continued: sampling parameters, model, response_format, embeddings.

tests/reliability/test_bad_input.py has the decisions this catalogue pins down.
"""

from __future__ import annotations

import pytest

from tests.reliability.bad_input import (
    CHAT,
    COMP,
    CONTEXT,
    EMB,
    VOCAB,
    Case,
    chat,
    check_openai_case,
    check_still_serves,
    comp,
)

CASES = [
    # -- max_tokens --
    Case(
        "max-tokens-negative",
        CHAT,
        chat(max_tokens=-3),
        400,
        "max_tokens",
        ("max_tokens", "at least 1"),
    ),
    Case("max-tokens-zero-chat", CHAT, chat(max_tokens=0), 400, "max_tokens", ("at least 1",)),
    Case("max-tokens-zero-echo-ok", COMP, comp(max_tokens=0, echo=True), 200, finish="length"),
    Case("max-tokens-huge", COMP, comp(prompt=[5] * 1000, max_tokens=10**30), 200, finish="length"),
    Case(
        "max-tokens-over-room", COMP, comp(prompt=[7] * 1020, max_tokens=100), 200, finish="length"
    ),
    # -- sampling ranges --
    Case(
        "temperature-negative",
        CHAT,
        chat(temperature=-0.1),
        400,
        "temperature",
        ("between 0 and 2",),
    ),
    Case(
        "temperature-too-high",
        COMP,
        comp(temperature=2.5),
        400,
        "temperature",
        ("between 0 and 2",),
    ),
    Case("top-p-negative", CHAT, chat(top_p=-1), 400, "top_p", ("between 0 and 1",)),
    Case("top-p-over-one", COMP, comp(top_p=1.01), 400, "top_p", ("between 0 and 1",)),
    Case(
        "top-logprobs-negative",
        CHAT,
        chat(logprobs=True, top_logprobs=-1),
        400,
        "top_logprobs",
        ("between 0 and 20",),
    ),
    Case(
        "stop-too-many",
        COMP,
        comp(stop=["a", "b", "c", "d", "e", "f"]),
        400,
        "stop",
        ("at most 4", "6"),
    ),
    Case("stop-too-long", CHAT, chat(stop="x" * 300), 400, "stop", ("at most 256",)),
    Case("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop", ("empty",)),
    Case("stop-an-object", CHAT, chat(stop={"a": 1}), 400, "stop", ("string",)),
    # -- the sampling set and n --
    Case("n-two", CHAT, chat(n=2), 200, finish="length"),
    Case("n-zero", COMP, comp(n=0), 400, "n", ("between 1 and 8", "0")),
    Case("n-hundred", CHAT, chat(n=100), 400, "n", ("between 1 and 8", "100")),
    Case("n-as-float", CHAT, chat(n=2.0), 400, "n", ("integer",)),
    Case("n-over-capacity", COMP, comp(prompt=["a", "b", "c"], n=8), 400, "n", ("24", "18")),
    Case("top-k-minus-one-is-off", CHAT, chat(top_k=-1, temperature=1), 200, finish="length"),
    Case("top-k-minus-two", COMP, comp(top_k=-2), 400, "top_k", ("top_k", "-2")),
    Case("top-k-float", CHAT, chat(top_k=1.5), 400, "top_k", ("integer",)),
    Case("min-p-negative", CHAT, chat(min_p=-0.1), 400, "min_p", ("between 0 and 1",)),
    Case("min-p-over-one", COMP, comp(min_p=1.1), 400, "min_p", ("between 0 and 1",)),
    Case(
        "repetition-penalty-zero",
        CHAT,
        chat(repetition_penalty=0),
        400,
        "repetition_penalty",
        ("above 0", "at most 2"),
    ),
    Case(
        "repetition-penalty-big",
        COMP,
        comp(repetition_penalty=2.5),
        400,
        "repetition_penalty",
        ("at most 2",),
    ),
    Case(
        "presence-penalty-low",
        CHAT,
        chat(presence_penalty=-2.01),
        400,
        "presence_penalty",
        ("between -2 and 2",),
    ),
    Case(
        "frequency-penalty-high",
        COMP,
        comp(frequency_penalty=3),
        400,
        "frequency_penalty",
        ("between -2 and 2",),
    ),
    Case(
        "frequency-penalty-string",
        CHAT,
        chat(frequency_penalty="high"),
        400,
        "frequency_penalty",
        ("number",),
    ),
    Case("logit-bias-list", CHAT, chat(logit_bias=[1, 2]), 400, "logit_bias", ("object",)),
    Case("logit-bias-word-key", CHAT, chat(logit_bias={"hi": 5}), 400, "logit_bias", ("'hi'",)),
    Case("logit-bias-negative-key", COMP, comp(logit_bias={"-1": 5}), 400, "logit_bias", ("-1",)),
    Case(
        "logit-bias-out-of-vocab",
        CHAT,
        chat(logit_bias={str(VOCAB): 5}),
        400,
        "logit_bias",
        (str(VOCAB), "vocabulary"),
    ),
    Case(
        "logit-bias-value-range",
        COMP,
        comp(logit_bias={"5": 101}),
        400,
        "logit_bias",
        ("between -100 and 100", "101"),
    ),
    Case(
        "logit-bias-value-string",
        CHAT,
        chat(logit_bias={"5": "ban"}),
        400,
        "logit_bias",
        ("between -100 and 100",),
    ),
    Case(
        "logit-bias-too-many",
        CHAT,
        chat(logit_bias={str(i): 1 for i in range(301)}),
        400,
        "logit_bias",
        ("at most 300", "301"),
    ),
    Case("logit-bias-ok", COMP, comp(logit_bias={"5": -100, "6": 2.5}), 200, finish="length"),
    Case("best-of-over-n", COMP, comp(best_of=2), 400, "best_of", ("best_of",)),
    Case("best-of-equal-n-ok", COMP, comp(best_of=2, n=2), 200, finish="length"),
    Case("suffix-refused", COMP, comp(suffix="end"), 400, "suffix", ("suffix",)),
    Case("functions-refused", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", ("tools",)),
    Case(
        "function-call-refused",
        CHAT,
        chat(function_call="auto"),
        400,
        "function_call",
        ("tool_choice",),
    ),
    Case("audio-refused", CHAT, chat(audio={"voice": "x"}), 400, "audio", ("audio",)),
    Case("modalities-audio", CHAT, chat(modalities=["text", "audio"]), 400, "modalities", ()),
    Case("modalities-text-ok", CHAT, chat(modalities=["text"]), 200, finish="length"),
    Case("prediction-not-object", CHAT, chat(prediction="x"), 400, "prediction", ("content",)),
    Case(
        "prediction-wrong-type",
        CHAT,
        chat(prediction={"type": "text", "content": "x"}),
        400,
        "prediction",
        ("content",),
    ),
    Case(
        "prediction-bad-parts",
        CHAT,
        chat(prediction={"type": "content", "content": [{"type": "image_url"}]}),
        400,
        "prediction",
        ("text parts",),
    ),
    Case(
        "prediction-ok",
        CHAT,
        chat(prediction={"type": "content", "content": [{"type": "text", "text": "x"}]}),
        200,
        finish="length",
    ),
    Case(
        "prediction-on-completions",
        COMP,
        comp(prediction={"type": "content", "content": "x"}),
        400,
        "prediction",
        ("chat/completions",),
    ),
    Case("verbosity-low", CHAT, chat(verbosity="low"), 400, "verbosity", ("verbosity",)),
    Case(
        "no-op-fields-ok",
        CHAT,
        chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto"),
        200,
        finish="length",
    ),
    # -- model and response_format --
    Case(
        "unknown-model",
        CHAT,
        chat(model="gpt-5-turbo"),
        404,
        "model",
        ("gpt-5-turbo", "does not exist", "serves"),
        "model_not_found",
    ),
    Case(
        "unknown-model-tokenize",
        "/tokenize",
        {"prompt": "hi", "model": "other"},
        404,
        "model",
        ("other",),
    ),
    Case(
        "format-unknown-type",
        CHAT,
        chat(response_format={"type": "yaml"}),
        400,
        "response_format.type",
        ("json_schema",),
    ),
    Case(
        "format-not-object", CHAT, chat(response_format="json"), 400, "response_format", ("object",)
    ),
    Case(
        "schema-missing",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        400,
        "response_format",
        ("json_schema", "schema"),
    ),
    Case(
        "schema-a-list",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        400,
        "response_format",
        ("JSON schema",),
    ),
    Case(
        "schema-bad-type",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "wizard"}},
            }
        ),
        400,
        "response_format",
        ("wizard",),
    ),
    Case(
        "schema-a-string",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": "not a schema"},
            }
        ),
        400,
        "response_format",
        ("schema",),
    ),
]

# -- /v1/embeddings (tests/api/test_embeddings.py has the route's full list) --
CASES += [
    Case("embed-no-input", EMB, {}, 400, "input", ("'input' is required",)),
    Case("embed-empty-string", EMB, {"input": ["a", ""]}, 400, "input[1]", ("empty string",)),
    Case("embed-id-outside-vocab", EMB, {"input": [1, VOCAB]}, 400, "input", ("vocabulary",)),
    Case("embed-too-long", EMB, {"input": [[1] * (CONTEXT + 1)]}, 400, "input[0]", ("1024",)),
    Case("embed-bad-format", EMB, {"input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
    Case("embed-dimensions-zero", EMB, {"input": "a", "dimensions": 0}, 400, "dimensions"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_parameter(http, case: Case):
    check_openai_case(http, case)


def test_catalogue_leaves_the_server_healthy(http):
    """After every case above (run first in this module) the server still serves."""
    check_still_serves(http)
