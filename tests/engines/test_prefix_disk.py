"""Prefix cache disk tier (--prefix-cache-dir) and --warm-prompts: a conversation's next turn
after a restart reads its prefix from disk with the same greedy output as cold; a flipped byte
is detected and the turn computed cold; other fingerprints' files are never read."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.kv.prefix_cache import PrefixCache
from llm_server.engines.kv.prefix_disk import (
    READ_TOKENS,
    DiskTier,
    checkpoint_digest,
    engine_fingerprint,
)
from llm_server.testing.live import serving
from llm_server.warm_prompts import load_warm_prompts

SYSTEM = {"role": "system", "content": "You are a careful coding agent. Use the tools. " * 12}


def _chat(srv, messages: list[dict]) -> dict:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        out = client.post("/v1/chat/completions", json=body)
    assert out.status_code == 200, out.text
    return out.json()


def _turns(srv) -> tuple[dict, list[dict]]:
    """Turn 1 on `srv`; the messages of turn 2 (turn 1, its answer, a new question)."""
    first = [SYSTEM, {"role": "user", "content": "list the files"}]
    one = _chat(srv, first)
    answer = one["choices"][0]["message"]["content"]
    return one, first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "now open the first one"},
    ]


def _metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", timeout=30).text


@pytest.fixture(scope="module")
def cold_turn2(tiny_model_path) -> tuple[list[dict], dict]:
    """Turn 2's messages and its answer with the prefix cache off."""
    with serving(tiny_model_path, prefix_cache_bytes=0) as srv:
        one, second = _turns(srv)
        return second, _chat(srv, second)


def test_next_turn_after_restart_reads_the_disk_tier(tiny_model_path, tmp_path, cold_turn2):
    second, cold = cold_turn2
    with serving(tiny_model_path, prefix_cache_dir=tmp_path) as srv:
        one, again = _turns(srv)
        assert again == second  # same greedy answer as the cold server's turn 1
    files = list(tmp_path.glob("kv_*/*.kv"))
    assert len(files) == 1  # the resident entry, written at shutdown
    size = files[0].stat().st_size
    with serving(tiny_model_path, prefix_cache_dir=tmp_path) as srv:
        two = _chat(srv, second)
        metrics = _metrics(srv)
        stats = srv.service.prefix_cache_stats()
    prompt1 = one["usage"]["prompt_tokens"]
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt1
    assert two["choices"] == cold["choices"]  # greedy output identical to cold
    assert stats.disk_reads == 1 and stats.disk_read_bytes == size
    assert "llm_server_prefix_cache_disk_reads_total 1.0" in metrics
    assert "llm_server_prefix_cache_misses_total 0.0" in metrics
    assert "llm_server_prefix_cache_hits 1.0" in metrics
    # at shutdown turn 2's entry, which extends turn 1's, replaced it on disk
    (left,) = tmp_path.glob("kv_*/*.kv")
    assert left != files[0] and left.stat().st_size > size


def test_a_flipped_byte_is_detected_and_the_turn_computed_cold(
    tiny_model_path, tmp_path, cold_turn2, caplog
):
    second, cold = cold_turn2
    with serving(tiny_model_path, prefix_cache_dir=tmp_path) as srv:
        _turns(srv)
    (path,) = tmp_path.glob("kv_*/*.kv")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit in the keys/values
    path.write_bytes(bytes(data))
    with (
        caplog.at_level(logging.WARNING),
        serving(tiny_model_path, prefix_cache_dir=tmp_path) as srv,
    ):
        two = _chat(srv, second)
        stats = srv.service.prefix_cache_stats()
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert two["choices"] == cold["choices"]
    assert stats.disk_corrupt == 1 and stats.disk_reads == 0
    warnings = [r for r in caplog.records if "prefix cache file" in r.getMessage()]
    assert len(warnings) == 1 and "checksum" in warnings[0].getMessage()
    assert not path.exists()  # never read again


def _kv(n: int, value: float = 1.0) -> tuple[list[mx.array], list[mx.array]]:
    return [mx.full((2, n, 4), value) for _ in range(2)], [
        mx.full((2, n, 4), -value) for _ in range(2)
    ]


def test_round_trip_truncation_and_stale_fingerprints(tmp_path, caplog):
    tokens = np.arange(10, 60, dtype=np.int32)
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    tier.put(tokens, *_kv(50, 2.5))
    tier.close()
    found = tier.load_longest(np.arange(10, 80, dtype=np.int32), 0)
    assert found is not None and found[0].tolist() == tokens.tolist()
    assert np.array_equal(np.asarray(found[1][1]), np.full((2, 50, 4), 2.5, np.float32))
    assert tier.load_longest(np.arange(10, 80, dtype=np.int32), 50) is None  # not longer
    # another model/dtype/kernel set: its own folder; a file moved into it is refused
    other = DiskTier(tmp_path, 1 << 20, "kv_b")
    assert other.load_longest(tokens, 0) is None
    (src,) = (tmp_path / "kv_a").glob("*.kv")
    (tmp_path / "kv_b" / src.name).write_bytes(src.read_bytes())
    with caplog.at_level(logging.WARNING):
        other = DiskTier(tmp_path, 1 << 20, "kv_b")
    assert other.load_longest(tokens, 0) is None and other.corrupt == 1
    assert "another model" in caplog.text
    src.write_bytes(src.read_bytes()[:-7])  # truncated: skipped at start
    again = DiskTier(tmp_path, 1 << 20, "kv_a")
    assert again.load_longest(tokens, 0) is None and again.corrupt == 1


def test_a_file_is_read_only_for_a_prefix_worth_its_read(tmp_path):
    """A few shared tokens (a chat template's opening) do not pull a long file in: a read
    needs READ_TOKENS shared tokens or an eighth of the file's."""
    tier = DiskTier(tmp_path, 1 << 30, "kv_a")
    long = np.arange(0, 2 * READ_TOKENS, dtype=np.int32)
    tier.put(long, *_kv(len(long)))
    tier.close()
    n = len(long) // 8

    def ask(shared: int) -> np.ndarray:
        return np.concatenate([long[:shared], np.full(8, 9999, np.int32)])

    assert tier.load_longest(ask(5), 0) is None
    assert tier.load_longest(ask(n - 1), 0) is None
    assert tier.load_longest(ask(n), 0) is not None
    assert tier.reads == 1


def test_disk_bound_and_extension_replace_older_files(tmp_path):
    old = tmp_path / "kv_old" / "x.kv"  # another fingerprint's file: deleted first
    old.parent.mkdir()
    old.write_bytes(b"0" * 30_000)
    tier = DiskTier(tmp_path, 40_000, "kv_a")  # a 100-token entry is ~6.5 KB
    tier.put(np.arange(0, 100, dtype=np.int32), *_kv(100))
    tier.put(np.arange(0, 150, dtype=np.int32), *_kv(150))  # extends the first: replaces it
    tier.flush()
    assert tier.stats()["disk_entries"] == 1 and not old.exists()
    for i in range(8):
        tier.put(np.arange(1000 * (i + 1), 1000 * (i + 1) + 100, dtype=np.int32), *_kv(100))
    tier.close()
    held = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
    assert held <= 40_000 and tier.stats()["disk_bytes"] == held


def test_the_fingerprint_changes_with_each_of_its_fields(tiny_model_path, tmp_path):
    base = {
        "checkpoint": checkpoint_digest(tiny_model_path),
        "dtype": "float32",
        "kernels": "linux_cpu",
        "fused": True,
        "quantized": False,
        "mlx_version": "0.30.0",
    }
    other = {
        "checkpoint": "another checkpoint",
        "dtype": "bfloat16",
        "kernels": "generic",
        "fused": False,
        "quantized": True,
        "mlx_version": "0.30.1",
    }
    key = engine_fingerprint(**base)
    assert key == engine_fingerprint(**base) and key.startswith("kv_")
    for name, value in other.items():
        assert engine_fingerprint(**{**base, name: value}) != key, name
    # the checkpoint's identity: its config's text (and its files' names, sizes, times)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_path, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert checkpoint_digest(copy) != checkpoint_digest(tiny_model_path)


def test_a_file_written_by_the_fused_forward_is_not_read_without_it(tiny_model_path, tmp_path):
    """The fused forward's KV and mlx-lm's differ in rounding: an engine without the fused
    forward never reads the other's files (the fingerprint once always said fused=False)."""
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    history = [int(t) for t in np.random.default_rng(5).integers(3, 380, 300)]

    def engine(fused: bool) -> MLXEngine:
        settings = EngineSettings(rows=1, fused_decode=fused, prefix_cache_dir=tmp_path)
        return MLXEngine(tiny_model_path, settings)

    fused = engine(True)
    assert fused.fused is not None
    fused.prefill(0, history)
    fused.release(0)
    fused.persist()  # as at shutdown: the row's history to disk, the writes finished
    plain = engine(False)
    assert plain.fused is None and plain.kv_fingerprint() != fused.kv_fingerprint()
    plain.prefill(0, history + [7, 8])
    assert plain.cached_tokens(0) == 0 and plain.prefix_cache.disk.reads == 0
    again = engine(True)  # the same engine after a restart reads it back
    again.prefill(0, history + [7, 8])
    assert again.cached_tokens(0) == len(history)


def test_warm_prompts_make_the_first_request_a_hit(tiny_model_path, tmp_path: Path):
    messages = [SYSTEM, {"role": "user", "content": "list the files"}]
    path = tmp_path / "warm.jsonl"
    path.write_text(
        json.dumps({"messages": messages}) + "\n" + json.dumps("plain text prompt") + "\n"
    )
    items = load_warm_prompts(path)
    with serving(tiny_model_path, warm_prompts=items) as srv:
        out = _chat(srv, messages)
    usage = out["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_bad_warm_prompts_file_names_the_item(tmp_path: Path):
    path = tmp_path / "warm.json"
    path.write_text(json.dumps(["ok", {"content": "no messages"}]))
    with pytest.raises(ValueError, match="item 1"):
        load_warm_prompts(path)


def test_entries_evicted_from_memory_are_read_back_from_disk(tmp_path):
    cache = PrefixCache(300 * 128)  # one 200-token entry at a time (128 bytes a position)
    cache.attach_disk(DiskTier(tmp_path, 1 << 20, "kv_a"))
    first, second = list(range(10, 210)), list(range(1000, 1200))
    cache.insert(first, *_kv(200, 1.5))
    cache.insert(second, *_kv(200))  # evicts `first` to disk
    cache.disk.flush()
    assert cache.stats().entries == 1 and cache.stats().disk_entries == 1
    entry, reused = cache.match(first + [7])
    assert reused == 200 and entry.tokens.tolist() == first
    assert np.array_equal(np.asarray(entry.keys[0]), np.full((2, 200, 4), 1.5, np.float32))
    stats = cache.stats()
    assert stats.disk_reads == 1 and stats.entries == 1  # `second` went to disk in its place
    cache.disk.flush()
    assert cache.stats().disk_entries == 2


def test_recent_gives_the_last_used_files_worth_a_read(tmp_path):
    """What a restart resumes (DiskTier.recent): most recently used first, at most `n`, none
    shorter than READ_TOKENS."""
    tier = DiskTier(tmp_path, 1 << 30, "kv_a")
    a = np.arange(0, READ_TOKENS + 10, dtype=np.int32)
    b = np.arange(5000, 5000 + READ_TOKENS, dtype=np.int32)
    short = np.arange(9000, 9000 + READ_TOKENS - 1, dtype=np.int32)
    for tokens, value in ((a, 1.0), (b, 2.0), (short, 3.0)):
        tier.put(tokens, *_kv(len(tokens), value))
        tier.flush()
    tier.close()
    again = DiskTier(tmp_path, 1 << 30, "kv_a")
    got = again.recent(5)
    assert [t.tolist() for t, *_ in got] == [b.tolist(), a.tolist()]
    assert np.array_equal(np.asarray(got[0][1][0]), np.full((2, len(b), 4), 2.0, np.float32))
    fresh = DiskTier(tmp_path, 1 << 30, "kv_a")  # (a read counts as a use)
    assert [t.tolist() for t, *_ in fresh.recent(1)] == [b.tolist()]
