"""The CLI's security and limit flags reach the app: a real `llm-server` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.helpers import assert_openai_error


@pytest.fixture
def cli_server(tiny_model_path):
    env = {**os.environ, "LLM_SERVER_API_KEY": "env-key-is-overridden"}
    cmd = [
        sys.executable,
        "-c",
        "from llm_server.cli import main; main()",
        "--model",
        str(tiny_model_path),
        "--port",
        "0",
        "--api-key",
        "cli-key",
        "--cors-origin",
        "http://ui.local",
        "--max-body-size",
        "1K",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "ready on" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            line = proc.stdout.readline()
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_cli_flags(cli_server):
    url = cli_server
    assert_openai_error(httpx.get(url + "/v1/models"), 401)
    assert_openai_error(
        httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-key-is-overridden"}),
        401,
    )
    auth = {"Authorization": "Bearer cli-key"}
    assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
    health = httpx.get(url + "/health").json()
    assert health["dtype"] == "float32"  # no --dtype: float32 on the CPU
    assert health["float32_precision"] == "full"  # MLX_ENABLE_TF32=0 unless the user set it
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    err = assert_openai_error(httpx.post(url + "/v1/chat/completions", json=big, headers=auth), 413)
    assert "1024" in err["message"]
    small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=small, headers=auth).status_code == 200
    pre = httpx.options(
        url + "/v1/models",
        headers={"Origin": "http://ui.local", "Access-Control-Request-Method": "GET"},
    )
    assert pre.headers["access-control-allow-origin"] == "http://ui.local"


def test_concurrent_requests_defaults_to_batching():
    from llm_server.cli import build_parser

    assert build_parser().parse_args([]).concurrent_requests == 4
    assert build_parser().parse_args(["--concurrent-requests", "1"]).concurrent_requests == 1


def test_every_flag_is_in_the_readme_flag_table():
    import argparse
    import re
    from pathlib import Path

    from llm_server.cli import build_parser

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme.split("| flag | meaning |", 1)[1].split("\n\n", 1)[0]
    flags = [
        flag
        for action in build_parser()._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]
    assert len(flags) > 30
    assert [f for f in flags if not re.search(rf"`{re.escape(f)}[` ]", table)] == []


def _half_checkpoint(src, dst, torch_dtype):
    """A copy of the tiny checkpoint whose config names `torch_dtype` (None: no such key)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("torch_dtype", None)
    if torch_dtype:
        config["torch_dtype"] = torch_dtype
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_dtype_default_is_float32_on_the_cpu_and_the_checkpoints_own_on_metal(
    tiny_model_path, tmp_path
):
    import json
    import struct

    from llm_server.cli import build_parser
    from llm_server.engines.mlx.dtypes import default_dtype

    assert build_parser().parse_args([]).dtype is None  # resolved by device at load
    assert build_parser().parse_args(["--dtype", "float16"]).dtype == "float16"
    bf16 = _half_checkpoint(tiny_model_path, tmp_path / "bf16", "bfloat16")
    assert default_dtype(bf16, on_cpu=True) == "float32"
    assert default_dtype(bf16, on_cpu=False) == "bfloat16"
    assert default_dtype(tiny_model_path, on_cpu=False) == "float32"  # a float32 checkpoint
    # no dtype in config.json: the first safetensors header's tensor dtype decides
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (bare / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    assert default_dtype(bare, on_cpu=False) == "float16"
    assert default_dtype(tmp_path / "x.gguf", on_cpu=False) == "float32"


def test_the_engine_resolves_no_dtype_by_device(tiny_model_path, tmp_path, monkeypatch):
    """EngineSettings(dtype=None), what the CLI passes without --dtype: float32 here (the CPU); with
    the device taken for Metal, the bf16 checkpoint's weights stay bfloat16; --dtype wins."""
    import mlx.core as mx

    from llm_server.engines.mlx import dtypes
    from llm_server.engines.mlx import engine as mlx_engine
    from llm_server.engines.settings import EngineSettings

    bf16 = _half_checkpoint(tiny_model_path, tmp_path / "bf16", "bfloat16")
    assert mlx_engine.MLXEngine(bf16).dtype == "float32"
    monkeypatch.setattr(mlx_engine, "default_dtype", lambda p: dtypes.default_dtype(p, False))
    engine = mlx_engine.MLXEngine(bf16)
    assert engine.dtype == "bfloat16"
    assert engine.model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert mlx_engine.MLXEngine(bf16, EngineSettings(dtype="float32")).dtype == "float32"


def test_prefill_tokens_reaches_the_scheduler_and_a_negative_value_is_refused(tiny_model_path):
    """--prefill-tokens (issue 38): the budget of a step with no decode row, passed to the
    BatchScheduler; below 0 the CLI stops with one line naming the flag."""
    import pytest

    from llm_server.cli import build_parser, main
    from llm_server.server import make_service
    from llm_server.settings import ServerSettings

    args = build_parser().parse_args(["--model", str(tiny_model_path), "--prefill-tokens", "2048"])
    service = make_service(ServerSettings.from_args(args), tiny_model_path)
    try:
        assert service.scheduler.prefill_tokens == 2048
        assert service.scheduler.step_tokens == args.step_tokens == 128
        assert service.scheduler.memory_wait == args.memory_wait == 30.0
    finally:
        service.close(30)
    with pytest.raises(SystemExit, match="--prefill-tokens must be 0"):
        main(["--model", str(tiny_model_path), "--prefill-tokens", "-1"])


def test_kv_keep_alive_reaches_the_engine_and_bad_values_are_refused(tiny_model_path, capsys):
    """--kv-keep-alive SECONDS (issue 38): how long an idle engine keeps its KV store; not a
    non-negative finite number: argparse's one-line error naming the flag, exit 2."""
    import pytest

    from llm_server.cli import build_parser
    from llm_server.server import make_service
    from llm_server.settings import ServerSettings

    args = build_parser().parse_args(["--model", str(tiny_model_path), "--kv-keep-alive", "2.5"])
    service = make_service(ServerSettings.from_args(args), tiny_model_path)
    try:
        assert service.scheduler.wait_ready(120).row_table.keep_alive == 2.5
    finally:
        service.close(30)
    assert build_parser().parse_args([]).kv_keep_alive == 60.0
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["--kv-keep-alive", bad])
        assert exc.value.code == 2
        assert f"--kv-keep-alive: expected seconds >= 0, e.g. 60 or 0.5, got '{bad}'" in (
            capsys.readouterr().err
        )


def test_the_command_line_is_read_once_into_server_settings(tmp_path):
    """ServerSettings.from_args: each flag in the part that uses it; a value the engine's
    settings refuse is one line naming it."""
    import pytest

    from llm_server.cli import _settings, build_parser
    from llm_server.settings import ServerSettings

    argv = ["--concurrent-requests", "3", "--dtype", "float16", "--max-queued", "5"]
    argv += ["--port", "0", "--cors-origin", "http://a", "--prefix-cache-dir", str(tmp_path)]
    argv += ["--compiled-decode", "off", "--tool-parser", "hermes", "--distributed", "ring"]
    argv += ["--memory-wait", "2.5"]
    settings = ServerSettings.from_args(build_parser().parse_args(argv))
    assert (settings.engine.rows, settings.engine.dtype) == (3, "float16")
    assert settings.engine.compiled_decode is False and settings.engine.prefix_cache_dir == tmp_path
    assert (settings.service.max_queued, settings.service.tool_parser) == (5, "hermes")
    assert settings.service.memory_wait == 2.5
    assert (settings.http.port, settings.http.cors_origins) == (0, ("http://a",))
    assert settings.distributed == "ring" and settings.engine.group is None
    assert settings.replace(rows=1, port=9, backend="mlx").engine.rows == 1
    with pytest.raises(TypeError, match="no field 'bogus'"):
        settings.replace(bogus=1)
    with pytest.raises(SystemExit, match="llm-server: prefix_cache_bytes must be >= 0, got -1"):
        _settings(build_parser().parse_args(["--prefix-cache-bytes", "-1"]))
