"""`llm-server --replay ... --replay-check` as a user runs it: exit 0 on a good log, 1 on a bad one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from llm_server.native.blas import preload_env


def _replay(model: Path, log: Path, report: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-c", "from llm_server.cli import main; main()",
        "--model", str(model), "--replay", str(log), "--replay-concurrent",
        "--concurrent-requests", "4", "--replay-check", "--replay-report", str(report),
        "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=preload_env())


def test_replay_check_exit_codes(recording, tiny_model_path, tmp_path) -> None:
    good = _replay(tiny_model_path, recording.path, tmp_path / "good.json")
    assert good.returncode == 0, good.stderr
    assert "identical 19/20, deterministic differing 0" in good.stdout
    assert "max rows busy 4" in good.stdout
    assert json.loads((tmp_path / "good.json").read_text())["totals"]["max_rows_busy"] == 4

    lines = recording.path.read_text().splitlines()
    entry = json.loads(lines[16])  # a temperature-0 plain completion
    assert entry["request"]["temperature"] == 0
    entry["response"]["choices"][0]["text"] = "altered" + entry["response"]["choices"][0]["text"]
    lines[16] = json.dumps(entry)
    altered = tmp_path / "altered.jsonl"
    altered.write_text("\n".join(lines) + "\n")
    bad = _replay(tiny_model_path, altered, tmp_path / "bad.json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "DIFFERS: choices[0].text at char 0" in bad.stdout
    assert "deterministic differing 1" in bad.stdout


def test_replay_flags_need_replay(tiny_model_path) -> None:
    cmd = [sys.executable, "-c", "from llm_server.cli import main; main()", "--replay-check"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=preload_env())
    assert done.returncode != 0
    assert "need --replay FILE" in done.stderr


def test_unreadable_log_is_a_clear_error(tiny_model_path, tmp_path) -> None:
    done = _replay(tiny_model_path, tmp_path / "missing.jsonl", tmp_path / "r.json")
    assert done.returncode != 0
    assert "cannot read the log" in done.stderr
