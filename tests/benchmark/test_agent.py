"""llm-benchmark --workload agent: the conversations it replays, the per-turn fields read from
our own server's real streams, and the CLI that runs it (our server as the peers too)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from llm_server.benchmark.agent_client import TurnResult, read_usage, run_turn, served_model
from llm_server.benchmark.agent_conversation import LOGS, build_conversation, check_fits, load_log
from llm_server.benchmark.cli import build_parser, settings_from
from llm_server.benchmark.servers import ServerSpec, running
from llm_server.testing.agents import build_agent_checkpoint
from llm_server.tokenizer import Tokenizer

OURS = f"{shlex.quote(sys.executable)} -c 'from llm_server.cli import main; main()'"


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The long-context (65,536) tiny checkpoint the agents tests serve."""
    return build_agent_checkpoint(tmp_path_factory.mktemp("agent") / "agent-tiny")


@pytest.mark.parametrize(("log", "tool"), [("codex", "exec_command"), ("claude-code", "Bash")])
def test_each_turn_is_the_whole_previous_prompt_plus_a_tool_round(agent_model, log, tool):
    tok = Tokenizer(agent_model)
    conv = build_conversation(load_log(log), 5)
    ids = [tok.apply_chat_template(m) for m in conv.turns]
    for before, after in zip(ids, ids[1:], strict=False):
        assert len(after) > len(before) + 200 and after[: len(before)] == before
    assert len(ids[0]) > 2000  # the recorded instructions and tool definitions
    system = conv.turns[0][0]["content"]
    assert f'"name":"{tool}"' in system and "# Tools" in system
    # roles alternate after the system message, as every chat template and server accepts
    roles = [m["role"] for m in conv.turns[-1]]
    assert roles == ["system"] + ["user", "assistant"] * 4 + ["user"]
    assert all(isinstance(m["content"], str) and m["content"] for m in conv.turns[-1])
    assert f'<tool_call>{{"name": "{tool}"' in conv.turns[1][2]["content"]


def test_conversations_are_deterministic_and_differ_after_the_shared_prefix():
    log = load_log("codex")
    first, again = build_conversation(log, 3), build_conversation(log, 3)
    assert json.dumps(first.turns) == json.dumps(again.turns)
    other = build_conversation(log, 3, conversation=1)
    assert other.turns[0][0] == first.turns[0][0]  # the recorded system prefix
    assert other.turns[2][-1] != first.turns[2][-1]


def test_a_chat_body_is_read_too(tmp_path):
    path = tmp_path / "log.json"
    body = {"messages": [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "run_shell",
                       "parameters": {"properties": {"line": {"type": "string"}}}}}]}  # fmt: skip
    path.write_text(json.dumps({"path": "/v1/chat/completions", "body": body}))
    conv = build_conversation(load_log(str(path)), 2)
    assert conv.turns[0][1] == {"role": "user", "content": "Hi"}
    assert '"name": "run_shell", "arguments": {"line":' in conv.turns[1][2]["content"]
    with pytest.raises(ValueError, match="no system/developer text or no user text"):
        path.write_text(json.dumps({"body": {"messages": []}}))
        build_conversation(load_log(str(path)), 2)
    with pytest.raises(ValueError, match="cannot read"):
        load_log(str(tmp_path / "missing.json"))


def test_smollm2_fits_five_codex_turns_in_its_context(default_model_path):
    tok = Tokenizer(default_model_path)
    conv = build_conversation(load_log("codex"), 5)
    sizes = check_fits(conv, lambda m: len(tok.apply_chat_template(m)), 8192, 32)
    assert sizes == sorted(sizes) and sizes[-1] + 32 <= 8192
    short = sizes[-1] + 31  # one token short of the last turn's prompt plus its answer
    with pytest.raises(ValueError, match=f"turn 5 .* {sizes[-1]} prompt tokens.* {short}-token"):
        check_fits(conv, lambda m: len(tok.apply_chat_template(m)), short, 32)


def test_llama_server_timings_give_cached_tokens():
    rec = TurnResult(2)
    read_usage(rec, {"choices": [], "timings": {"cache_n": 3000, "prompt_n": 812}})
    assert (rec.prompt_tokens, rec.cached_tokens, rec.new_tokens) == (3812, 3000, 812)
    assert rec.cache_source == "timings"
    none = TurnResult(1)
    read_usage(none, {"usage": {"prompt_tokens": 50, "completion_tokens": 3}})
    assert none.cached_tokens is None and none.new_tokens is None and none.prefill_tok_s is None


@pytest.mark.timeout(240)
def test_turn_fields_come_from_our_servers_streams(agent_model, tmp_path):
    tok = Tokenizer(agent_model)
    conv = build_conversation(load_log("codex"), 2)
    spec = ServerSpec("ours", agent_model, 1, 2)
    with running(spec, tmp_path / "ours.log") as srv, httpx.Client(timeout=120) as client:
        model = served_model(client, srv.url)
        turns = [run_turn(client, srv.url, m, i, 8, model) for i, m in enumerate(conv.turns, 1)]
    for rec, messages in zip(turns, conv.turns, strict=True):
        assert rec.error is None and rec.ttft_s is not None and rec.ttft_s <= rec.total_s
        assert rec.prompt_tokens == len(tok.apply_chat_template(messages))
        assert rec.cache_source == "usage" and 0 <= rec.cached_tokens <= rec.prompt_tokens
        assert rec.new_tokens == rec.prompt_tokens - rec.cached_tokens
        assert rec.prefill_tok_s == pytest.approx(rec.new_tokens / rec.ttft_s)
        assert 1 <= rec.completion_tokens <= 8
    assert model is not None and turns[0].cached_tokens == 0  # a fresh server


def test_the_agent_workload_flags(tiny_model_path):
    parse = build_parser().parse_args
    s = settings_from(parse(["--model", str(tiny_model_path), "--workload", "agent"]))
    assert (s.workload, s.max_tokens, s.agent_log, s.agent_turns, s.agent_conversations) == (
        "agent",
        32,
        "codex",
        5,
        1,
    )
    peers = ["--peer", "llama-server", "--peer-cmd", "ls --port {port}",
             "--peer", "vllm-mlx", "--peer-cmd", "vllm-mlx serve {model} --port {port}"]  # fmt: skip
    args = ["--model", str(tiny_model_path), *peers]
    s = settings_from(parse([*args, "--workload", "agent", "--agent-log", "claude-code"]))
    assert [k for k, _ in s.peers] == ["llama_server", "vllm_mlx"] and s.agent_log == "claude-code"
    with pytest.raises(SystemExit, match="several --peer only with --workload agent"):
        settings_from(parse(args))
    with pytest.raises(SystemExit, match="--peer and --peer-cmd go together"):
        settings_from(parse([*args, "--peer", "rapid-mlx", "--workload", "agent"]))
    with pytest.raises(SystemExit, match="--agent-turns"):
        settings_from(parse(["--model", str(tiny_model_path), "--workload", "agent",
                             "--agent-turns", "0"]))  # fmt: skip
    assert set(LOGS) == {"codex", "claude-code"}


@pytest.mark.timeout(300)
def test_the_cli_runs_every_server_turn_by_turn_and_reports_them(agent_model, tmp_path):
    out = tmp_path / "out"
    peer = f"{OURS} --model {{model}} --port {{port}}"
    cmd = [sys.executable, "-c", "from llm_server.benchmark.cli import main; main()",
           "--workload", "agent", "--model", str(agent_model), "--out", str(out), "--no-mlx-lm",
           "--agent-turns", "2", "--max-tokens", "4", "--peer", "llama-server", "--peer-cmd", peer,
           "--peer", "rapid-mlx", "--peer-cmd", "/nonexistent/rapid-mlx serve --port {port}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "benchmark.json").read_text())
    assert list(report["servers"]) == ["ours", "llama_server", "rapid_mlx"]
    assert [f["server"] for f in report["failures"]] == ["rapid_mlx"]  # reported, run went on
    argv = report["servers"]["llama_server"]["command"]
    assert argv[argv.index("--model") + 1] == str(agent_model) and "{port}" not in argv
    for name in ("ours", "llama_server"):
        (conv,) = report["servers"][name]["conversations"]
        assert [t["turn"] for t in conv["turns"]] == [1, 2]
        assert [t["prompt_tokens"] for t in conv["turns"]] == report["meta"]["prompt_tokens_by_template"][0]  # fmt: skip
        assert conv["peak_rss_bytes"] > 0 and conv["total_s"] > 0
    md = (out / "benchmark.md").read_text()
    assert "| turn | llm-server | llama-server |" in md
    assert "| conversation | turn | TTFT s | prompt tokens | cached tokens | new tokens" in md
    assert "- rapid_mlx: " in md
    assert (out / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
