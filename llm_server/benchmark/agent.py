"""`llm-benchmark --workload agent`: agent conversations replayed turn by turn on every server.

Each server (ours, mlx_lm.server unless --no-mlx-lm, then every --peer in the order given) is
started fresh, warmed up with one short request, and sent the same conversations
(agent_conversation), one request at a time, each turn after the previous one's stream ended.
A server that fails to start or to answer is recorded and the run goes on with the next one.
Writes benchmark.json, benchmark.md and benchmark.png (TTFT per turn per server).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from llm_server.benchmark import agent_report, memory, servers
from llm_server.benchmark.agent_client import run_turn, served_model
from llm_server.benchmark.agent_conversation import (
    Conversation,
    build_conversation,
    check_fits,
    load_log,
)
from llm_server.benchmark.runner import OutputPaths, _git_commit, _machine
from llm_server.benchmark.settings import Settings

WARMUP = [{"role": "user", "content": "Say hello."}]


def model_context(model: Path) -> int | None:
    """max_position_embeddings from the model's config.json (None when it does not say)."""
    try:
        cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text_cfg = cfg.get("text_config") or {}
    value = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings")
    return int(value) if value else None


def conversations(s: Settings) -> tuple[list[Conversation], list[list[int]]]:
    """The run's conversations and each turn's prompt tokens (the model's own chat template);
    SystemExit when the log is unreadable or a conversation does not fit the context."""
    from llm_server.tokenizer import Tokenizer

    try:
        log = load_log(s.agent_log)
        convs = [build_conversation(log, s.agent_turns, i) for i in range(s.agent_conversations)]
    except ValueError as exc:
        raise SystemExit(f"llm-benchmark: {exc}") from None
    tok = Tokenizer(s.model)
    context = model_context(s.model)
    sizes = []
    for conv in convs:
        try:
            sizes.append(
                check_fits(
                    conv,
                    lambda m: len(tok.apply_chat_template(m)),
                    context or 1 << 30,
                    s.max_tokens,
                )  # fmt: skip
            )
        except ValueError as exc:
            raise SystemExit(f"llm-benchmark: {exc}") from None
    return convs, sizes


def tree_peak_bytes(pid: int) -> int:
    """Peak RSS of `pid` plus that of each of its live descendants (a server that forks
    workers); on Linux, from /proc; elsewhere the process alone."""
    pids = [pid]
    if os.path.isdir("/proc"):
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
        i = 0
        while i < len(pids):
            pids.extend(children.get(pids[i], []))
            i += 1
    total = 0
    for p in pids:
        try:
            total += memory.sample(p).peak_bytes
        except (OSError, ValueError, KeyError):
            continue  # a process that ended between listing and reading
    return total


def specs(s: Settings) -> list[tuple[str, servers.ServerSpec]]:
    """(report name, spec) of each server in run order; one request at a time on each."""
    extra: tuple[str, ...] = ()
    if s.step_tokens is not None:
        extra += ("--step-tokens", str(s.step_tokens))
    if s.speculative is not None:
        extra += ("--speculative", s.speculative)
    out = [("ours", servers.ServerSpec("ours", s.model, 1, 2, extra_args=extra))]
    if s.mlx_lm:
        out.append(("mlx_lm", servers.ServerSpec("mlx_lm", s.model, 1, 2)))
    for kind, cmd in s.peers:
        name = kind
        while name in dict(out):  # the same peer twice (two venvs or settings): kind-2, ...
            name = f"{kind}-{sum(1 for n, _ in out if n.startswith(kind)) + 1}"
        out.append((name, servers.ServerSpec(kind, s.model, 1, 2, peer_cmd=cmd)))
    return out


def _one_server(
    s: Settings, name: str, spec: servers.ServerSpec, convs: list[Conversation]
) -> dict:
    entry: dict = {"kind": spec.kind, "label": servers.PEER_LABELS.get(spec.kind, spec.kind),
                   "conversations": [], "error": None}  # fmt: skip
    print(f"llm-benchmark agent: {name}: starting", flush=True)
    with servers.running(spec, s.out / "logs" / f"agent-{name}.log") as srv:
        entry.update(command=list(srv.command), pid=srv.pid)
        with httpx.Client(trust_env=False, timeout=1800.0) as client:
            model = served_model(client, srv.url)
            entry["model_id"] = model
            warm = run_turn(client, srv.url, WARMUP, 0, s.max_tokens, model)
            if warm.error:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
            for conv in convs:
                t0 = time.perf_counter()
                turns = []
                for i, messages in enumerate(conv.turns, 1):
                    rec = run_turn(client, srv.url, messages, i, s.max_tokens, model)
                    turns.append(rec.as_dict())
                    print(f"  {name} {conv.id} turn {i}: ttft {rec.ttft_s or 0:.2f} s, prompt "
                          f"{rec.prompt_tokens}, cached {rec.cached_tokens}"
                          + (f", error {rec.error}" if rec.error else ""), flush=True)  # fmt: skip
                    if rec.error:
                        break
                entry["conversations"].append({
                    "id": conv.id, "turns": turns, "total_s": time.perf_counter() - t0,
                    "peak_rss_bytes": tree_peak_bytes(srv.pid),
                })  # fmt: skip
    return entry


def run_agent(s: Settings) -> OutputPaths:
    convs, sizes = conversations(s)
    s.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "meta": {
            "workload": "agent", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": _machine(), "git_commit": _git_commit(),
            "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "model": str(s.model), "model_name": s.model.name,
            "context": model_context(s.model), "agent_log": s.agent_log,
            "source_path": convs[0].source, "turns": s.agent_turns,
            "conversations": s.agent_conversations, "max_tokens": s.max_tokens,
            "prompt_tokens_by_template": sizes,
        },
        "servers": {},
        "failures": [],
    }  # fmt: skip
    for name, spec in specs(s):
        try:
            report["servers"][name] = _one_server(s, name, spec, convs)
        except (servers.ServerStartError, RuntimeError, ValueError, OSError) as exc:
            report["servers"][name] = {"kind": spec.kind, "conversations": [], "error": str(exc)}
            report["failures"].append({"server": name, "error": str(exc)})
            print(f"llm-benchmark agent: {name} failed: {exc}", flush=True)
    report["meta"]["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    paths = OutputPaths(s.out / "benchmark.json", s.out / "benchmark.md", s.out / "benchmark.png")
    paths.json.write_text(json.dumps(report, indent=2) + "\n")
    paths.markdown.write_text(agent_report.markdown(report))
    agent_report.write_plot(report, paths.plot)
    return paths
