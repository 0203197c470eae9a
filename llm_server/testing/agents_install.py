"""The real coding agents, pinned, installed from the npm registry into a cache folder.

`python -m llm_server.testing.agents_install` installs every pinned agent that is missing
(`make test-agents` runs it); an installed one costs a `stat`. Each version lives in its own
folder, `~/.cache/llm-server/agents/<name>-<version>` (`LLM_SERVER_AGENTS_CACHE` moves the
root), installed with `npm install --prefix`, so a new pin never disturbs an old one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Agent:
    """One npm package and the program it installs."""

    name: str
    package: str
    version: str
    program: str


# The one place the versions are pinned.
AGENTS = {
    "codex": Agent("codex", "@openai/codex", "0.171.0", "codex"),
    "claude-code": Agent("claude-code", "@anthropic-ai/claude-code", "2.1.332", "claude"),
    "qwen-code": Agent("qwen-code", "@qwen-code/qwen-code", "0.24.4", "qwen"),
    "opencode": Agent("opencode", "opencode-ai", "1.18.33", "opencode"),
}


def cache_root() -> Path:
    env = os.environ.get("LLM_SERVER_AGENTS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "llm-server" / "agents"


def agent_dir(agent: Agent) -> Path:
    return cache_root() / f"{agent.name}-{agent.version}"


def program_path(agent: Agent) -> Path:
    return agent_dir(agent) / "node_modules" / ".bin" / agent.program


def installed(agent: Agent) -> bool:
    return program_path(agent).exists() and (agent_dir(agent) / ".complete").exists()


def install(agent: Agent) -> Path:
    """The agent's program, installed first when missing; raises when npm fails."""
    if installed(agent):
        return program_path(agent)
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed (Debian: apt-get install nodejs npm)")
    folder = agent_dir(agent)
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--prefix", str(folder), "--no-audit", "--no-fund"]
    cmd += ["--loglevel=error", f"{agent.package}@{agent.version}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if not program_path(agent).exists():
        raise RuntimeError(f"{agent.package}@{agent.version} installed no {agent.program}")
    (folder / ".complete").write_text(f"{agent.package}@{agent.version}\n")
    return program_path(agent)


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(AGENTS)
    for name in names:
        agent = AGENTS[name]
        already = installed(agent)
        path = install(agent)
        print(f"{agent.package}@{agent.version}: {path}{' (cached)' if already else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
