"""Each real agent as shipped, one-shot: it answers, and it runs one of its own tools."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest

from llm_server.testing.agents_proxy import (
    RecordingProxy,
    answer_text,
    call_ids,
    calls_made,
    tool_results,
    tool_schema,
)
from llm_server.testing.agents_run import run_agent
from tests.agents.conftest import AGENT_NAMES, FORCED_TOOL

MODEL = "agent-tiny"


def _check_calls(proxy: RecordingProxy, run) -> list:
    calls = proxy.model_calls()
    assert calls, f"the agent sent no model request\n{run.describe()}"
    for ex in calls:
        assert ex.status == 200, (
            f"{ex.path} -> {ex.status}: {ex.response[:600]!r}\n{run.describe()}"
        )
    return calls


@pytest.mark.parametrize("name", AGENT_NAMES)
def test_one_shot_prints_the_answer(name: str, agent_server, tmp_path: Path) -> None:
    with RecordingProxy(agent_server.url) as proxy:
        run = run_agent(name, proxy.url, MODEL, "Say hello.", tmp_path)
    assert run.returncode == 0, run.describe()
    calls = _check_calls(proxy, run)
    # Qwen Code asks the model more than once (a side request after the answer), so the
    # printed answer is one of the answers, not necessarily the last.
    answers = [answer_text(ex).strip() for ex in calls]
    assert any(answers), f"every answer was empty\n{run.describe()}"
    printed = [a for a in answers if a and a in run.stdout]
    assert printed, f"none of the answers {answers!r} was printed\n{run.describe()}"


@pytest.mark.parametrize("name", AGENT_NAMES)
def test_forced_tool_round_trip(name: str, agent_server, tmp_path: Path) -> None:
    """The first request offering the tool is forced to call it: the agent runs it, sends the
    result back, and the server answers that request with 200."""
    with RecordingProxy(agent_server.url, force_tool=FORCED_TOOL[name]) as proxy:
        run = run_agent(name, proxy.url, MODEL, "List the files here.", tmp_path)
    calls = _check_calls(proxy, run)
    forced = [i for i, ex in enumerate(calls) if ex.forced]
    assert forced, f"no request offered {FORCED_TOOL[name]}\n{run.describe()}"
    first = calls[forced[0]]
    ids = call_ids(first)
    assert ids, f"the forced answer made no call: {first.response[-800:]!r}"
    made = calls_made(first)
    assert len(made) == len(ids), made
    assert [n for n, _ in made] == [FORCED_TOOL[name]] * len(made)
    for tool, arguments in made:
        jsonschema.validate(arguments, tool_schema(first.path, first.body, tool))
    answered = [ex for ex in calls[forced[0] + 1 :] if set(ids) & set(tool_results(ex))]
    assert answered, f"no later request carried the result of {ids}\n{run.describe()}"
    assert answered[0].status == 200
    assert run.returncode == 0, run.describe()
