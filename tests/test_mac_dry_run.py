"""What a Mac skips, shown here: the linux_cpu marker under a pretended platform, and the memory
reader the tests use taking the path macOS takes (`ps`) with the same answer as /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _pytest(*args: str, pretend: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLM_SERVER_PRETEND_PLATFORM"}
    if pretend:
        env["LLM_SERVER_PRETEND_PLATFORM"] = pretend
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_pretended_mac_skips_exactly_the_linux_cpu_tests():
    files = ["tests/engines/test_decode_attention.py", "tests/test_makefile.py"]
    listed = _pytest("--collect-only", "-q", "-m", "linux_cpu", *files, pretend="darwin")
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/engines/test_decode_attention.py::") for i in ids)
    ran = _pytest("-q", "-rs", "tests/engines/test_decode_attention.py", pretend="darwin")
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert f"{len(ids)} skipped" in ran.stdout
    assert "asserts the Linux CPU path (BLIS/skinny arithmetic, CPU defaults); darwin" in ran.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compares with /proc")
def test_the_memory_reader_agrees_with_proc_on_the_ps_path():
    from llm_server.benchmark import memory

    proc = memory._proc_status(os.getpid())
    ps = memory._ps(os.getpid())
    assert proc is not None and proc.source == "proc" and ps.source == "ps"
    assert abs(ps.rss_bytes - proc.rss_bytes) < 0.1 * proc.rss_bytes
