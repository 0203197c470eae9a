"""Context limits as the agents see them, and a second turn served from the prefix cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import llm_server
from llm_server.testing.agents_proxy import RecordingProxy, prompt_usage
from llm_server.testing.agents_run import run_agent
from llm_server.testing.live import serving
from tests.agents.conftest import STEP_TOKENS

MODEL = "agent-tiny"
CONTEXT = 24576  # holds Codex's (~12k) and Claude Code's (~15k) prompt, not 32000 more tokens


@pytest.fixture(scope="module")
def small_server(agent_model_path: Path):
    with serving(
        agent_model_path, concurrent=1, step_tokens=STEP_TOKENS, context_length=CONTEXT
    ) as srv:
        yield srv


def _long_prompt() -> str:
    """About 17k tokens of this package's own source: an agent's prompt no longer fits. `api/` is
    read with its subfolders, so moving files into folders never shortens the prompt."""
    root = Path(llm_server.__file__).parent / "api"
    text = "".join(p.read_text() for p in sorted(root.rglob("*.py")))
    assert len(text) >= 60000, "the package's api/ source is shorter than the prompt needs"
    return "Summarize this code.\n\n" + text[:60000]


def _refusals(proxy: RecordingProxy) -> list:
    return [ex for ex in proxy.model_calls() if ex.status == 400]


def test_codex_shows_its_out_of_context_message(small_server, tmp_path: Path) -> None:
    with RecordingProxy(small_server.url) as proxy:
        run = run_agent("codex", proxy.url, MODEL, _long_prompt(), tmp_path)
    refused = _refusals(proxy)
    assert refused, run.describe()
    error = json.loads(refused[0].response)["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"the context holds {CONTEXT}" in error["message"]
    assert run.returncode != 0
    assert "ran out of room in the model's context window" in run.stdout + run.stderr


def test_claude_code_reads_prompt_is_too_long(small_server, tmp_path: Path) -> None:
    with RecordingProxy(small_server.url) as proxy:
        run = run_agent("claude-code", proxy.url, MODEL, _long_prompt(), tmp_path)
    refused = _refusals(proxy)
    assert refused, run.describe()
    message = json.loads(refused[0].response)["error"]["message"]
    tokens = re.fullmatch(rf"prompt is too long: (\d+) tokens > {CONTEXT} maximum", message)
    assert tokens, message
    # Claude Code parses the numbers and says so (a one-exchange conversation cannot compact).
    assert run.returncode == 1
    assert f"Prompt is too long · the request is ~{tokens[1]} tokens (limit {CONTEXT})" in (
        run.stdout
    ), run.describe()


def test_claude_code_retries_with_fewer_max_tokens(small_server, tmp_path: Path) -> None:
    """Its 32,000 `max_tokens` do not fit beside its prompt: Anthropic's words make it retry
    with what is left, and the retry is served."""
    with RecordingProxy(small_server.url) as proxy:
        run = run_agent("claude-code", proxy.url, MODEL, "Say hello.", tmp_path)
    calls = proxy.model_calls()
    first = calls[0]
    assert first.status == 400 and first.body["max_tokens"] == 32000, run.describe()
    message = json.loads(first.response)["error"]["message"]
    found = re.match(
        rf"input length and `max_tokens` exceed context limit: (\d+) \+ 32000 > {CONTEXT}", message
    )
    assert found, message
    retry = calls[1]
    assert retry.status == 200, run.describe()
    assert int(found[1]) + retry.body["max_tokens"] <= CONTEXT
    assert run.returncode == 0, run.describe()


@pytest.mark.parametrize("name", ["codex", "claude-code"])
def test_second_turn_reuses_the_prefix_cache(name: str, agent_server, tmp_path: Path) -> None:
    """`codex exec resume --last` / `claude --continue`: cached >= 90% of the first prompt."""
    with RecordingProxy(agent_server.url) as proxy:
        first = run_agent(name, proxy.url, MODEL, "Say hello.", tmp_path)
    assert first.returncode == 0, first.describe()
    earlier, _ = prompt_usage(proxy.model_calls()[-1])
    with RecordingProxy(agent_server.url) as proxy:
        second = run_agent(name, proxy.url, MODEL, "Say more.", tmp_path, resume=True)
    assert second.returncode == 0, second.describe()
    prompt, cached = prompt_usage(proxy.model_calls()[-1])
    assert prompt > earlier
    assert cached >= 0.9 * earlier, (prompt, cached, earlier)
