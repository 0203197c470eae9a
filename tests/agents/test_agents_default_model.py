"""The embedded SmolLM2 (8,192 positions, no tool syntax in its template) behind an agent.

Of the four agents only opencode's prompt fits 8,192 positions (about 7,700 tokens with its
ten tools); Codex's (~9,200), Claude Code's (~12,400) and Qwen Code's (~14,300) are refused
in each API's own words, which the agents print.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_server.testing.agents_proxy import RecordingProxy, answer_text, prompt_usage
from llm_server.testing.agents_run import run_agent
from llm_server.testing.live import serving


@pytest.fixture(scope="module")
def default_server(default_model_path: Path):
    with serving(default_model_path, concurrent=1) as srv:
        yield srv


def test_opencode_on_the_default_model(default_server, tmp_path: Path) -> None:
    # Declared as opencode's docs declare a local model: an output limit, so a 135M model that
    # rambles at temperature 1 stops at 512 tokens, not 32,000 (a title once took 400 s);
    # context 0 ("unknown"), since with 8,192 declared opencode reserves the output's room
    # and compacts after every turn of its 7,700-token prompt, in a loop.
    with RecordingProxy(default_server.url) as proxy:
        run = run_agent(
            "opencode", proxy.url, "default", "Say hello.", tmp_path, timeout=420, limit=(0, 512)
        )
    assert run.returncode == 0, run.describe()
    calls = proxy.model_calls()
    assert [ex.status for ex in calls] == [200] * len(calls), run.describe()
    main = max(calls, key=lambda ex: len(ex.body.get("tools") or []))
    assert len(main.body["tools"]) >= 5  # its tools, shown in the generic tool format
    assert {ex.body["max_tokens"] for ex in calls} == {512}
    assert prompt_usage(main)[0] <= 8192
    # At temperature 1 the 135M model's first answer is now and then a call of one of the
    # tools (1 in 20 replays of this request): opencode runs it and asks again, and prints
    # that later answer. Some answer it received is printed.
    answers = [answer_text(ex).strip() for ex in calls]
    assert any(a and a in run.stdout for a in answers), f"{answers!r}\n{run.describe()}"


def test_codex_prompt_does_not_fit_the_default_model(default_server, tmp_path: Path) -> None:
    with RecordingProxy(default_server.url) as proxy:
        run = run_agent("codex", proxy.url, "default", "Say hello.", tmp_path)
    assert [ex.status for ex in proxy.model_calls()][:1] == [400]
    assert "ran out of room in the model's context window" in run.stdout + run.stderr
