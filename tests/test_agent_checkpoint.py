"""The agents' tiny checkpoint (llm_server/testing/agents.py): its answers are short and never
empty, whatever the prompt and however the first token is sampled."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from llm_server.benchmark.agent_conversation import build_conversation, load_log
from llm_server.testing.agents import build_agent_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_checkpoint(tmp_path_factory.mktemp("agent") / "agent-tiny")


def test_eos_follows_only_a_period(checkpoint):
    model, tok = load(str(checkpoint))
    messages = build_conversation(load_log("codex"), 2).turns[1]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)[-1500:]
    logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    eos, period = tok.eos_token_id, tok.convert_tokens_to_ids(".")
    after = np.array(ids)
    # Nothing but a `.` puts anything on the stop dimension, and the EOS row reads only it:
    # after any other token the EOS logit is exactly 0, far below the likeliest token's.
    others = after != period
    assert others.sum() > 1000 and (after == period).sum() > 10
    assert np.all(logits[others, eos] == 0.0)
    assert np.all(logits[others].max(axis=1) > 5.0)
    # After a `.` the EOS is the likeliest token.
    assert np.all(logits[~others].argmax(axis=1) == eos)


def test_a_sampled_first_token_is_never_the_eos(checkpoint):
    model, tok = load(str(checkpoint))
    for text in ("Say hello.", "List the files here", "{}", "\n"):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        probs = mx.softmax(model(mx.array([ids]))[0, -1].astype(mx.float32))
        assert float(probs[tok.eos_token_id]) < 1e-4, text
