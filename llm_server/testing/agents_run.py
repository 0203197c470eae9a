"""Run a real coding agent one-shot against a server, configured as a user would.

Each agent gets only the base URL, a dummy key and the model id, in a fresh home folder, and
nothing that switches a feature off; the only extra settings keep it off the network
(telemetry, auto-update), since nothing but the package registries is reachable in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llm_server.testing.agents_install import AGENTS, install

KEY = "unused"
# Inherited variables that would configure an agent behind the test's back.
_FOREIGN = ("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_", "QWEN_", "OPENCODE_", "GEMINI_")
_QUIET = {  # network avoidance only
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "NO_UPDATE_NOTIFIER": "1",
}


@dataclass
class AgentRun:
    """What an agent printed and how it exited."""

    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (
            f"exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n"
            + (self.stderr[-3000:])
        )


def codex_config(home: Path, base_url: str, model: str) -> None:
    """`$CODEX_HOME/config.toml` with a custom Responses provider (README "Codex CLI")."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "llm-server"\n\n'
        "[model_providers.llm-server]\n"
        'name = "llm-server"\n'
        f'base_url = "{base_url}/v1"\n'
        'env_key = "LLM_SERVER_API_KEY"\n'
        'wire_api = "responses"\n'
    )


def opencode_config(
    work: Path,
    base_url: str,
    model: str,
    limit: tuple[int, int] | None = None,
) -> None:
    """`opencode.json` in the project folder declaring an OpenAI-compatible provider.

    `limit` is (context, output) as opencode's docs declare a local model's: opencode then
    asks for at most `output` tokens per call instead of 32,000 (a context of 0 is its
    "unknown": no compaction).
    """
    entry: dict = {"name": model}
    if limit is not None:
        entry["limit"] = {"context": limit[0], "output": limit[1]}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "llm-server": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "llm-server",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": KEY},
                "models": {model: entry},
            }
        },
        "model": f"llm-server/{model}",
    }
    (work / "opencode.json").write_text(json.dumps(config, indent=2))


def agent_command(
    name: str,
    base_url: str,
    model: str,
    prompt: str,
    root: Path,
    resume: bool = False,
    limit: tuple[int, int] | None = None,
    images: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str], Path]:
    """(argv, environment, working folder) for one non-interactive run of agent `name`;
    `images`: files attached to the prompt (`codex exec -i FILE`, the one agent with a flag)."""
    if limit is not None and name != "opencode":
        raise ValueError(f"{name} takes no model limit in its configuration (only opencode does)")
    if images and name != "codex":
        raise ValueError(f"{name} takes no image flag (only codex: exec -i FILE)")
    program = str(install(AGENTS[name]))
    home, work = root / "home", root / "work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
    env.update(_QUIET, HOME=str(home), PWD=str(work))
    if name == "codex":
        codex_config(home / ".codex", base_url, model)
        env.update(CODEX_HOME=str(home / ".codex"), LLM_SERVER_API_KEY=KEY)
        head = [program, "exec"] + (["resume", "--last"] if resume else [])
        # after the prompt: `-i` takes several files and would take the prompt as one
        attached = [a for path in images for a in ("-i", path)]
        argv = head + ["--skip-git-repo-check", prompt, *attached]
    elif name == "claude-code":
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_AUTH_TOKEN=KEY, ANTHROPIC_MODEL=model)
        argv = [program, "-p", prompt] + (["--continue"] if resume else [])
    elif name == "qwen-code":
        env.update(OPENAI_BASE_URL=f"{base_url}/v1", OPENAI_API_KEY=KEY, OPENAI_MODEL=model)
        argv = [program, "-p", prompt] + (["--continue"] if resume else [])
    elif name == "opencode":
        opencode_config(work, base_url, model, limit)
        argv = [program, "run", prompt] + (["--continue"] if resume else [])
    else:
        raise KeyError(name)
    return argv, env, work


def run_agent(
    name: str,
    base_url: str,
    model: str,
    prompt: str,
    root: Path,
    resume: bool = False,
    timeout: float = 300,
    limit: tuple[int, int] | None = None,
    images: tuple[str, ...] = (),
) -> AgentRun:
    """Run agent `name` one-shot in `root` (its home and project folders live there).

    `limit` (context, output) is declared in the config of the agents that take one (opencode).
    """
    argv, env, work = agent_command(name, base_url, model, prompt, root, resume, limit, images)
    done = subprocess.run(
        argv,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return AgentRun(done.returncode, done.stdout, done.stderr)
