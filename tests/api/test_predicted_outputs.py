"""OpenAI Predicted Outputs (`prediction`) through the official SDK against a live server: the
predicted text drafts for its request, greedy output is unchanged, and usage counts the
prediction tokens accepted and rejected (issue 19)."""

from __future__ import annotations

import openai
import pytest

from llm_server.scheduler.spec_policy import StepCosts

MESSAGES = [{"role": "user", "content": "Repeat the list: apples, pears, plums, figs."}]
N = 24


class _EveryDraftPays(StepCosts):
    """The policy's cut (spec_policy.py) weighs drafts by measured step times, which a loaded
    machine can make say "no draft pays"; these tests check verification and its counts, so
    every candidate draft is verified whole."""

    def lengths(self, decoding: int, rows: dict[int, tuple[float, int]]) -> dict[int, int]:
        return {row: most for row, (_, most) in rows.items()}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    """Two batched rows, `--speculative off`: a prediction drafts in any mode."""
    from llm_server.testing.live import serving

    with serving(tiny_model_path, concurrent=2, speculative="off") as srv:
        srv.service.scheduler.spec_costs = _EveryDraftPays()
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def words(server) -> dict[str, float]:
    """A logit bias that keeps the random tiny model's greedy answer to a few whole-word
    tokens, so its text tokenizes back to exactly the tokens it was made of."""
    tok = server.service.tokenizer
    ids = [tok.encode(w, add_special_tokens=False) for w in (" is", " you", " of", " capital")]
    assert all(len(i) == 1 for i in ids)
    return {str(i[0]): 100.0 for i in ids}


@pytest.fixture(scope="module")
def plain(client, server, words):
    """The greedy answer without a prediction, and its token ids."""
    done = client.chat.completions.create(
        model=server.state.model_id,
        messages=MESSAGES,
        max_tokens=N,
        temperature=0,
        logit_bias=words,
    )
    text = done.choices[0].message.content
    ids = server.service.tokenizer.encode(text, add_special_tokens=False)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == N
    assert len(ids) == N and {str(i) for i in ids} <= set(words)  # the text round-trips
    assert done.usage.completion_tokens_details is None  # no prediction, no counts
    return text, ids


@pytest.fixture(scope="module")
def ask(client, server, words):
    def call(prediction, **kw):
        return client.chat.completions.create(
            model=server.state.model_id,
            messages=MESSAGES,
            max_tokens=N,
            temperature=0,
            logit_bias=words,
            prediction=prediction,
            **kw,
        )

    return call


def test_a_prediction_equal_to_the_output_is_accepted_whole(ask, server, plain) -> None:
    text, ids = plain
    before = server.service.scheduler.accepted_tokens
    done = ask({"type": "content", "content": text})
    assert done.choices[0].message.content == text
    assert done.choices[0].finish_reason == "length"
    details = done.usage.completion_tokens_details
    assert done.usage.completion_tokens == N
    assert details.accepted_prediction_tokens == N
    assert details.rejected_prediction_tokens == 0
    assert server.service.scheduler.accepted_tokens > before  # the drafts did ride along


def test_text_parts_and_streaming_report_the_same_counts(ask, server, plain) -> None:
    text, _ = plain
    half = len(text) // 2
    parts = [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]
    whole = ask({"type": "content", "content": text})
    chunks = list(
        ask(
            {"type": "content", "content": parts},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens_details == whole.usage.completion_tokens_details


def test_a_wrong_prediction_changes_nothing_but_the_counts(ask, server, plain) -> None:
    text, ids = plain
    tok = server.service.tokenizer
    # the output's first third, then tokens the output never has: the first draft past the
    # third is rejected whatever lengths the policy drafts (the tiny model's output repeats
    # itself, so a wrong stretch followed by the right tokens could be skipped by re-aligning)
    absent = tok.encode(" zebra quartz violin", add_special_tokens=False)
    assert not set(absent) & set(ids)
    wrong = ids[: N // 3] + [absent[i % len(absent)] for i in range(N - N // 3)]
    done = ask({"type": "content", "content": tok.decode(wrong)})
    assert done.choices[0].message.content == text
    assert done.usage.completion_tokens == N
    details = done.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0
    assert 0 < details.accepted_prediction_tokens < N
    unrelated = ask({"type": "content", "content": "zzz qqq"})
    assert unrelated.choices[0].message.content == text
