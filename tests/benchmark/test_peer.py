"""llm-benchmark --peer: a server started from a user's command runs the same load.

llama-server is not installed here, so the peer in the end-to-end run is our own server
started from a --peer-cmd template: it exercises the templating, the /health wait, the load,
the report's peer tables and the peer targets exactly as a llama-server binary would.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from llm_server.benchmark.cli import build_parser, settings_from
from llm_server.benchmark.servers import peer_command
from llm_server.testing.tiny import build_tiny_checkpoint


def test_peer_command_fills_in_port_and_concurrency():
    argv = peer_command(
        "llama-server -m 'my model.gguf' --host {host} --port {port} -np {concurrency}", 8123, 4
    )
    assert argv == ["llama-server", "-m", "my model.gguf", "--host", "127.0.0.1", "--port", "8123", "-np", "4"]  # fmt: skip


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("llama-server -m x.gguf", r"must contain \{port\}"),
        ("llama-server --port {port} -t {threads}", r"may name only \{port\}, \{concurrency\}, \{host\}"),
    ],
)  # fmt: skip
def test_a_bad_peer_command_is_refused_before_the_run(template, message, tiny_model_path):
    args = build_parser().parse_args(
        ["--model", str(tiny_model_path), "--peer", "llama-server", "--peer-cmd", template]
    )
    with pytest.raises(SystemExit, match=message):
        settings_from(args)


def test_peer_and_peer_cmd_go_together(tiny_model_path):
    args = build_parser().parse_args(["--model", str(tiny_model_path), "--peer", "llama-server"])
    with pytest.raises(SystemExit, match="--peer and --peer-cmd go together"):
        settings_from(args)


@pytest.mark.timeout(240)
def test_a_peer_runs_the_same_load_and_is_reported(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "tiny-qwen3")
    peer = (
        f"{shlex.quote(sys.executable)} -c 'from llm_server.cli import main; main()' "
        f"--model {shlex.quote(str(model))} --port {{port}} --concurrent-requests {{concurrency}}"
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from llm_server.benchmark.cli import main; main()",
           "--quick", "--model", str(model), "--out", str(out), "--no-mlx-lm", "--concurrency", "1",
           "--scoring-prompts", "0", "--peer", "llama-server", "--peer-cmd", peer,
           "--rounds", "2"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "benchmark.json").read_text())
    assert report["failures"] == []
    assert report["meta"]["peer"] == {
        "kind": "llama_server",
        "label": "llama-server",
        "command": peer,
    }
    # two rounds, each server started fresh in each
    assert sorted(report["meta"]["commands"]) == [
        "llama_server-c1-r1", "llama_server-c1-r2", "ours-c1-r1", "ours-c1-r2"
    ]  # fmt: skip
    argv = report["meta"]["commands"]["llama_server-c1-r2"]["argv"]
    assert argv[argv.index("--concurrent-requests") + 1] == "1" and "{port}" not in argv
    run = report["servers"]["llama_server"]["1"]
    assert run["requests"] == run["ok_requests"] == 4
    for name in ("ours", "llama_server"):
        kept = report["servers"][name]["1"]
        assert len(kept["rounds_tokens_per_s"]) == 2 and kept["round"] in (1, 2)
        assert kept["tokens_per_s"] == min(kept["rounds_tokens_per_s"])  # the lower middle of 2
        assert kept["same_outputs_every_round"] is True
    # the same greedy text from the same model, whichever server ran it
    ours = [o["text"] for o in report["outputs"]["ours"]["1"]]
    assert [o["text"] for o in report["outputs"]["llama_server"]["1"]] == ours
    peer_targets = {t["id"]: t for t in report["targets"] if t["id"].startswith("peer_")}
    assert sorted(peer_targets) == [
        "peer_throughput_c1",
        "peer_throughput_c4",
        "peer_throughput_c8",
    ]
    assert peer_targets["peer_throughput_c1"]["met"] is not None
    assert peer_targets["peer_throughput_c4"]["met"] is None  # concurrency 4 was not run
    md = (out / "benchmark.md").read_text()
    assert "## Throughput and latency against llama-server (cells: ours / llama-server)" in md
    assert "| concurrency | tok/s ours | tok/s llama_server | ours/llama_server |" in md
    assert "| concurrency | tok/s ours by round | tok/s llama_server by round |" in md
