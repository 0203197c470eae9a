"""The KV formats benchmark's parts on a tiny checkpoint: one format's memory in this process,
a decode step's time at a concurrency."""

from __future__ import annotations

from llm_server.benchmark.kv_formats import FORMATS, _memory_here, _step_s
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.testing.families import build_family_checkpoint


def test_memory_and_rate_of_a_format(tmp_path):
    path = build_family_checkpoint(tmp_path / "llama", "llama")
    got = _memory_here(str(path), "int8", 64)
    assert got["format"] == "int8/g64" and set(got) >= {"kv_held_mb", "peak_rss_mb"}
    engine = MLXEngine(path, EngineSettings(rows=2, kv_keep_alive=0, **FORMATS["float16"]))
    assert _step_s(engine, 2, 16, 2, seed=0) > 0
    assert engine.cursor(0) == 0  # its rows released
