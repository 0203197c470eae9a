"""Prefix cache edges the conversation tests do not reach: an entry over the bound, a trunk
that is not split again, a bound no leaf can be evicted for; the disk tier's bfloat16 files,
cut writes, corrupt or vanished files, a repeated put, an entry over the disk bound and a
failed write."""

from __future__ import annotations

import logging
import struct

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.kv.prefix_cache import PrefixCache
from llm_server.engines.kv.prefix_disk import MAGIC, DiskTier


def _kv_positions(tokens: list[int]) -> tuple[list[mx.array], list[mx.array]]:
    """KV whose every position carries its token id (2 layers, 2 heads x 4 dims, 128 B/pos)."""
    ids = mx.array(tokens, dtype=mx.float32)[None, :, None]
    keys = [mx.broadcast_to(ids, (2, len(tokens), 4)) + layer for layer in range(2)]
    return keys, [-k for k in keys]


def _same_kv(entry, tokens: list[int]) -> bool:
    want_k, want_v = _kv_positions(tokens)
    return all(
        np.array_equal(np.asarray(got), np.asarray(want))
        for got, want in zip(entry.keys + entry.values, want_k + want_v, strict=True)
    )


def test_an_entry_over_the_bound_is_not_stored_and_evicts_nothing():
    cache = PrefixCache(300 * 128)
    kept = list(range(10, 210))
    cache.insert(kept, *_kv_positions(kept))
    big = list(range(1000, 1301))  # 301 positions: one more than the whole bound
    cache.insert(big, *_kv_positions(big))
    assert cache.stats().entries == 1 and cache.bytes == 200 * 128
    assert cache.match(big + [1]) == (None, 0)
    entry, reused = cache.match(kept + [1])
    assert reused == 200 and _same_kv(entry, kept)


def test_a_trunk_is_not_split_again_for_a_shorter_shared_prefix():
    cache = PrefixCache(10_000 * 128)
    system = list(range(1000, 1400))
    a, b = system + list(range(10, 110)), system + list(range(200, 300))
    cache.insert(a, *_kv_positions(a))
    cache.insert(b, *_kv_positions(b))  # a trunk of the 400 system tokens, two tails
    a2 = a + list(range(3000, 3050))  # a's next turn replaces a; the trunk is listed first now
    cache.insert(a2, *_kv_positions(a2))
    assert cache.stats().entries == 3 and cache.bytes == (400 + 150 + 100) * 128
    c = system[:300] + list(range(5000, 5200))  # shares 300 of the trunk's 400 tokens
    cache.insert(c, *_kv_positions(c))
    # c holds all its 500 positions itself: the trunk keeps its 400 (no trunk of a trunk)
    assert cache.stats().entries == 4 and cache.bytes == (400 + 150 + 100 + 500) * 128
    for conv in (a2, b, c):
        entry, reused = cache.match(conv + [7])
        assert reused == len(conv) and _same_kv(entry, conv)
    assert cache.match(system + [7])[1] == 400


def test_the_bound_holds_when_only_the_new_entrys_trunk_is_left():
    cache = PrefixCache(700 * 128)
    system = list(range(1000, 1400))
    a, b = system + list(range(10, 110)), system + list(range(200, 300))
    cache.insert(a, *_kv_positions(a))
    cache.insert(b, *_kv_positions(b))
    d = system + list(range(3000, 3600))  # a 600-token tail fits the bound, trunk + tail not
    cache.insert(d, *_kv_positions(d))
    assert cache.bytes <= cache.max_bytes
    assert cache.match(system + [7])[1] == 400  # the trunk is still served


def _put(tier: DiskTier, tokens: list[int], dtype=mx.float32) -> None:
    keys, values = _kv_positions(tokens)
    tier.put(
        np.asarray(tokens, np.int32),
        [k.astype(dtype) for k in keys],
        [v.astype(dtype) for v in values],
    )


def test_bfloat16_entries_round_trip_bit_for_bit(tmp_path):
    tokens = list(range(300, 340))
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    _put(tier, tokens, mx.bfloat16)
    tier.close()
    got_tokens, keys, values, _ = tier.load_longest(np.asarray(tokens + [1], np.int32), 0)
    assert got_tokens.tolist() == tokens
    want_k, want_v = _kv_positions(tokens)
    for got, want in zip(keys + values, want_k + want_v, strict=True):
        assert got.dtype == mx.bfloat16
        bits = np.asarray(mx.view(want.astype(mx.bfloat16), mx.uint16))
        assert np.array_equal(np.asarray(mx.view(got, mx.uint16)), bits)


def _one_file(tmp_path, tokens: list[int]):
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    _put(tier, tokens)
    tier.close()
    (path,) = (tmp_path / "kv_a").glob("*.kv")
    return path


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda data: b"NOTPKV1\n" + data[8:], "not a prefix cache file"),
        (lambda data: MAGIC + struct.pack("<Q", (1 << 20) + 1) + data[16:], "header too long"),
        (lambda data: data[: 16 + struct.unpack_from("<Q", data, 8)[0] + 20], "truncated"),
    ],
    ids=["magic", "header-length", "token-ids"],
)
def test_a_damaged_file_is_skipped_with_a_warning_and_deleted(tmp_path, caplog, damage, says):
    tokens = list(range(300, 340))
    path = _one_file(tmp_path, tokens)
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="llm_server.engines.kv.prefix_disk"):
        tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    assert says in caplog.text and tier.corrupt == 1 and not path.exists()
    assert tier.load_longest(np.asarray(tokens + [1], np.int32), 0) is None
    assert tier.stats()["disk_entries"] == 0


def test_a_write_cut_short_is_deleted_at_start(tmp_path):
    path = _one_file(tmp_path, list(range(300, 340)))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(path.read_bytes()[:50])  # the server died mid-write
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    assert not tmp.exists() and path.exists()
    assert tier.stats()["disk_entries"] == 1 and tier.corrupt == 0


def test_a_file_changed_after_the_scan_is_refused_at_read(tmp_path, caplog):
    tokens = list(range(300, 340))
    path = _one_file(tmp_path, tokens)
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    path.write_bytes(path.read_bytes() + b"\0" * 16)  # grown since the scan: size disagrees
    with caplog.at_level(logging.WARNING, logger="llm_server.engines.kv.prefix_disk"):
        assert tier.load_longest(np.asarray(tokens + [1], np.int32), 0) is None
    assert "truncated or from another fingerprint" in caplog.text
    assert tier.corrupt == 1 and not path.exists() and tier.stats()["disk_entries"] == 0


def test_a_file_deleted_by_another_server_is_forgotten_quietly(tmp_path, caplog):
    tokens = list(range(300, 340))
    path = _one_file(tmp_path, tokens)
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    path.unlink()  # another server's bound on the same folder
    with caplog.at_level(logging.WARNING, logger="llm_server.engines.kv.prefix_disk"):
        assert tier.load_longest(np.asarray(tokens + [1], np.int32), 0) is None
    assert caplog.text == "" and tier.corrupt == 0
    assert tier.stats()["disk_entries"] == 0


def test_tokens_already_on_disk_are_not_written_again(tmp_path):
    tokens = list(range(300, 340))
    path = _one_file(tmp_path, tokens)
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    before = path.stat().st_mtime_ns
    _put(tier, tokens)
    tier.close()
    assert tier.writes == 0 and path.stat().st_mtime_ns == before
    assert tier.stats()["disk_entries"] == 1


def test_an_entry_over_the_disk_bound_is_not_written(tmp_path):
    tier = DiskTier(tmp_path, 10_000, "kv_a")  # 100 positions take ~13 KB
    _put(tier, list(range(300, 400)))
    _put(tier, list(range(500, 520)))  # ~2.7 KB: fits
    tier.close()
    assert tier.writes == 1 and tier.stats()["disk_entries"] == 1
    assert [p.stat().st_size <= 10_000 for p in (tmp_path / "kv_a").glob("*.kv")] == [True]


def test_a_failed_write_is_logged_and_the_writer_goes_on(tmp_path, caplog):
    tier = DiskTier(tmp_path, 1 << 20, "kv_a")
    tier.dir.rmdir()  # the folder vanished (a cleanup, an unmounted disk): open() fails
    with caplog.at_level(logging.WARNING, logger="llm_server.engines.kv.prefix_disk"):
        _put(tier, list(range(300, 340)))
        tier.flush()
    assert "could not write" in caplog.text and tier.writes == 0
    tier.dir.mkdir()
    _put(tier, list(range(600, 640)))  # the same writer thread writes the next entry
    tier.close()
    assert tier.writes == 1
    assert tier.load_longest(np.asarray(list(range(600, 641)), np.int32), 0) is not None
