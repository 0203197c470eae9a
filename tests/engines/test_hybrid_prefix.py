"""Hybrid models (recurrent layers + attention) keep their prefix through state checkpoints.

For every hybrid family mlx-lm provides (tiny random checkpoints, llm_server/testing/families.py):
a conversation's next turn resumes from the checkpoint at the end of the last answer (the kept
row in place, another row, the prefix cache, the disk tier after a restart), a prompt diverging
inside the history resumes from the latest checkpoint before the divergence, and the greedy
answer equals the same prompt computed cold and with the prefix cache off, served alone and
batched with other requests through the real BatchScheduler.
"""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.engines.kv.rows import CHECKPOINT_SPACING, MAX_CHECKPOINTS
from llm_server.engines.kv.state import checkpoint_bytes
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.tokenizer import Tokenizer
from tests.scheduler.helpers import make_request, start_scheduler

HYBRIDS = [
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
    "lfm2",
]
NEW = 6
SYSTEM = 600  # past one CHECKPOINT_SPACING: a spacing checkpoint and the prompt's end


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 380, n)]


def generate(engine: MLXEngine, row: int, prompt: list[int], n: int = NEW) -> list[int]:
    """Greedy ids; the last one is not fed back (as the scheduler leaves it)."""
    logits, out = engine.prefill(row, prompt), []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == n:
            return out
        logits = engine.decode([row], [out[-1]])[0]


def cold(path, prompt: list[int], **kw) -> list[int]:
    return generate(MLXEngine(path, EngineSettings(rows=1, **kw)), 0, prompt)


@pytest.mark.parametrize("family", HYBRIDS)
def test_next_turn_resumes_from_a_checkpoint_exactly(family, checkpoint):
    """Turn 2 over the kept row resumes at the end of turn 1's answer (>= 95% of turn 1's
    prompt cached); a prompt diverging inside the history resumes from the latest checkpoint
    before it (a spacing one), on another row through the prefix cache; every answer equals
    the prompt cold and with the cache off."""
    path = checkpoint(family)
    engine = MLXEngine(path, EngineSettings(rows=2))
    assert engine.prefix_cache.enabled and engine.prefix_cache.stateful
    assert engine.speculative and not engine.pipelined  # (test_hybrid_speculation.py)
    system = _ids(1, SYSTEM)
    answer = generate(engine, 0, system)
    engine.release(0)
    assert sorted(engine.row_table.marks[0]) == [CHECKPOINT_SPACING, SYSTEM, SYSTEM + NEW - 1]
    turn2 = system + answer + _ids(2, 15)  # (the answer's last id is not in the row yet)
    got = generate(engine, 0, turn2)
    assert engine.cached_tokens(0) == SYSTEM + NEW - 1 >= 0.95 * SYSTEM
    assert got == cold(path, turn2) == cold(path, turn2, prefix_cache_bytes=0)
    engine.release(0)
    engine.row_table.save_kept()  # row 0's history into the prefix cache
    edited = system[:550] + _ids(3, 20)  # diverges after the spacing checkpoint at 512
    got = generate(engine, 1, edited)
    assert engine.cached_tokens(1) == CHECKPOINT_SPACING
    assert got == cold(path, edited, prefix_cache_bytes=0)


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid", "falcon_h1"])
def test_kept_row_rewinds_to_a_checkpoint_in_place(family, checkpoint):
    """A conversation's row whose next prompt diverges inside its history rewinds to the
    checkpoint before the divergence in place (its KV cut there, its state restored)."""
    path = checkpoint(family)
    engine = MLXEngine(path, EngineSettings(rows=1))
    system = _ids(4, SYSTEM)
    generate(engine, 0, system)
    engine.release(0)
    edited = system[:590] + _ids(5, 10)  # diverges between the 512 and 600 checkpoints
    assert engine.preferred_row(edited, [0]) == 0
    got = generate(engine, 0, edited)
    assert engine.cached_tokens(0) == CHECKPOINT_SPACING
    assert got == cold(path, edited, prefix_cache_bytes=0)


@pytest.mark.parametrize("family", HYBRIDS)
def test_batched_turns_through_the_scheduler(family, checkpoint):
    """Through the real BatchScheduler: turn 2 resumed from its checkpoint while another
    request prefills and decodes in the same steps equals it served with the cache off."""
    path = checkpoint(family)
    tok = Tokenizer(path)
    system, other = _ids(6, SYSTEM), _ids(7, 40)
    off = start_scheduler(path, 2, prefix_cache_bytes=0)
    sched = start_scheduler(path, 2)
    try:
        req, first = make_request(tok, system, NEW, ignore_eos=True)
        sched.submit(req)
        assert first.done.wait(60)
        turn2 = system + first.tokens + _ids(8, 12)
        outs = []
        for prompt in (turn2, other):
            req, out = make_request(tok, prompt, NEW, ignore_eos=True)
            outs.append(out)
            sched.submit(req)
        assert all(o.done.wait(60) for o in outs)
        assert outs[0].finish.cached_tokens >= 0.95 * len(system)
        want = []
        for prompt in (turn2, other):
            req, out = make_request(tok, prompt, NEW, ignore_eos=True)
            off.submit(req)
            assert out.done.wait(60)
            want.append(out.tokens)
        assert [o.tokens for o in outs] == want
    finally:
        sched.close(10)
        off.close(10)


def test_checkpoints_count_in_the_bound_and_evict_with_their_entry(checkpoint):
    """An entry's bytes are its KV and its checkpoints'; the cache stays under its bound."""
    path = checkpoint("qwen3_5")
    engine = MLXEngine(path, EngineSettings(rows=1))
    system = _ids(9, SYSTEM)
    generate(engine, 0, system)
    engine.release(0)
    marks = dict(engine.row_table.marks[0])
    engine.row_table.save_kept()
    cache = engine.prefix_cache
    (entry,) = cache._entries.values()
    kv = sum(k.nbytes + v.nbytes for k, v in zip(entry.keys, entry.values, strict=True))
    states = sum(checkpoint_bytes(m) for m in marks.values())
    assert states > 0 and cache.bytes == entry.nbytes == kv + states
    bound = 2 * entry.nbytes + entry.nbytes // 2
    small = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=bound))
    for seed in range(10, 14):  # four conversations, room for two
        generate(small, 0, _ids(seed, SYSTEM), 2)
        small.release(0)
        small.row_table.save_kept()
        assert small.prefix_cache.bytes <= bound
    assert small.prefix_cache.stats().entries == 2


def test_checkpoints_are_thinned_to_the_maximum(checkpoint):
    """A long history keeps at most MAX_CHECKPOINTS, the latest always among them."""
    path = checkpoint("lfm2")
    engine = MLXEngine(path, EngineSettings(rows=1))
    table = engine.row_table
    engine.prefill(0, _ids(15, 20))
    for _ in range(MAX_CHECKPOINTS + 4):
        engine.decode([0], [5])
        table._checkpoint(0)
    assert len(table.marks[0]) == MAX_CHECKPOINTS and engine.cursor(0) in table.marks[0]


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid"])
def test_a_restart_resumes_from_the_disk_tier(family, checkpoint, tmp_path):
    """The disk tier stores the checkpoints (its fingerprint names the state layout): after
    a restart the next turn resumes from the answer's end, read back from disk."""
    path = checkpoint(family)
    settings = EngineSettings(rows=1, prefix_cache_dir=tmp_path, kv_keep_alive=60.0)
    engine = MLXEngine(path, settings)
    assert "states=" not in engine.kv_fingerprint()  # (a digest: see state_layout)
    assert engine.state_layout()
    system = _ids(17, SYSTEM)
    answer = generate(engine, 0, system)
    engine.release(0)
    engine.persist()
    again = MLXEngine(path, settings)
    assert again.prefix_cache.stats().disk_reads == 1
    turn2 = system + answer + _ids(18, 10)
    got = generate(again, 0, turn2)
    assert again.cached_tokens(0) == SYSTEM + NEW - 1
    assert got == cold(path, turn2, prefix_cache_bytes=0)
    fresh = MLXEngine(path, EngineSettings(rows=1, prefix_cache_dir=tmp_path))  # no resume
    edited = system[:550] + _ids(19, 10)
    got = generate(fresh, 0, edited)
    assert fresh.cached_tokens(0) == CHECKPOINT_SPACING
    assert got == cold(path, edited, prefix_cache_bytes=0)
