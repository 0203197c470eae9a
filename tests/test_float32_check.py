"""The start-up product check: one re-exec at most on Linux, a warning and service elsewhere.

A failing check is forced by replacing `blas._wrong_product` in a child process (the code runs
again after a re-exec, so every generation of the process fails it). On an M5 Mac the check
would fail for real with MLX_ENABLE_TF32=1; macOS is simulated by patching `sys.platform`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from llm_server.native import blas

TF32 = "MLX_ENABLE_TF32"  # dropped from the children's env: the entry point must set it

FORCE_WRONG = (
    "import os, sys\n"
    "from llm_server.native import blas\n"
    "blas._wrong_product = lambda: '1x576x1536 product is wrong'\n"
    "print('generation', os.environ.get('LLM_SERVER_BLAS_REEXEC'), flush=True)\n"
)


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("LD_PRELOAD", "BLIS_NUM_THREADS", "GLIBC_TUNABLES", "LLM_SERVER_BLAS_REEXEC", TF32)
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


@pytest.mark.skipif(blas.chosen_blas({}) is None, reason="no BLIS or OpenBLAS preloaded here")
def test_a_failing_check_on_linux_re_execs_once_never_twice():
    code = FORCE_WRONG + "print('served', blas.check_blas(), flush=True)\n"
    env = blas.preload_env(_clean_env())
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["generation None", "generation fallback", "served False"]
    assert out.stderr.count("restarting once with") == 1
    assert out.stderr.count("serving anyway") == 1


def test_no_check_re_execs_without_a_preloaded_blas():
    """LLM_SERVER_BLAS=off on Linux (the reference BLAS): a wrong product is a warning only."""
    code = FORCE_WRONG + "print('served', blas.check_blas(), flush=True)\n"
    env = _clean_env(LLM_SERVER_BLAS="off")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["generation None", "served False"]
    assert out.stderr.count("serving anyway") == 1


def test_macos_with_a_failing_check_serves_with_one_warning(tiny_model_path):
    """sys.platform patched to darwin, every product 'wrong', os.execve fatal: the server
    starts, answers /health with the float32 precision it runs at, and warned once."""
    code = (
        "import sys\n"
        "import llm_server.cli, llm_server.server\n"  # the stdlib's import-time darwin branches
        "sys.platform = 'darwin'\n"  # as the code under test reads it
        + FORCE_WRONG
        + "def no_exec(*a):\n"
        "    print('EXEC', a[1], flush=True)\n"
        "    os._exit(99)\n"
        "os.execve = os.execvpe = no_exec\n"
        "from llm_server.cli import main\n"
        "main()\n"
    )
    args = ["--model", str(tiny_model_path), "--port", "0", "--log-level", "warning"]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=_clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines, deadline = [], time.monotonic() + 120
        while not lines or "ready on" not in lines[-1]:
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline())
        assert lines[0].strip() == "generation None"
        url = lines[-1].rsplit(" ", 1)[1].strip()
        health = httpx.get(url + "/health").json()
        assert health["ready"] and health["blas"] == "accelerate"
        assert health["float32_precision"] == "full"  # MLX_ENABLE_TF32=0 set by the entry point
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert "EXEC" not in out
    assert err.count("serving anyway") == 1, err
    assert "MLX_ENABLE_TF32=0" in err


def test_the_users_tf32_choice_is_kept_and_reported():
    env: dict[str, str] = {}
    blas.exact_float32(env)
    assert env == {"MLX_ENABLE_TF32": "0"}
    env = {"MLX_ENABLE_TF32": "1"}
    blas.exact_float32(env)
    assert env == {"MLX_ENABLE_TF32": "1"}
    code = "from llm_server.native import blas; print(blas.float32_precision())"
    for value, want in (("1", "tf32"), ("0", "full")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=_clean_env(MLX_ENABLE_TF32=value),
            capture_output=True,
            text=True,
        )
        assert out.stdout.strip() == want, out.stderr
