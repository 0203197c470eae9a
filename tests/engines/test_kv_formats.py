"""KV formats (engines/kv/format.py, --kv-dtype / --kv-bits): the exactness promise per format.

Within a format a row's arithmetic does not depend on batching (S10): greedy output of rows
started at different decode steps equals each row alone, for float16 and 8-bit KV on every
batching family and for bfloat16 and 4-bit on a subset (plain, sliding-window, gated delta and
convolution layers); drafts verified and rewound leave the output exactly as plain decoding;
scoring rows give the same log-probabilities beside a decoding row as alone. The store holds
the format's bytes, the disk tier never reads another format's file, and the values drift
from float32 KV only by the format's rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.kv.format import KVFormat, bytes_per_element
from llm_server.engines.kv.prefix_disk import CorruptEntry, DiskTier
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.plan import DecodeRow, ScoreChunk, StepPlan
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler.scorer import Scorer
from tests.engines.test_families import BATCHED, LENGTHS, staggered

NEW = 8
# the tiny families' heads hold 16 values: groups of 32 (each head padded to one group)
FORMATS = {
    "float16": {"kv_dtype": "float16"},
    "bfloat16": {"kv_dtype": "bfloat16"},
    "int8": {"kv_bits": 8, "kv_group_size": 32},
    "int4": {"kv_bits": 4, "kv_group_size": 32},
}
SUBSET = ["llama", "gemma3_text", "qwen3_5", "lfm2"]
CROSS = [(f, fam) for f in ("float16", "int8") for fam in BATCHED]
CROSS += [(f, fam) for f in ("bfloat16", "int4") for fam in SUBSET]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(3, 380, n)] for n in LENGTHS]


def _alone(engine: MLXEngine, prompt: list[int], n: int) -> list[int]:
    logits, out = engine.prefill(0, prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.decode([0], [out[-1]])[0]
    engine.release(0)
    return out


@pytest.mark.parametrize(("fmt", "family"), CROSS)
def test_batched_equals_alone_per_format(fmt, family, checkpoint, prompts):
    path = checkpoint(family)
    kw = FORMATS[fmt]
    one = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=0, **kw))
    assert not one.kv_format.identity
    expected = [_alone(one, p, NEW) for p in prompts]
    engine = MLXEngine(path, EngineSettings(rows=4, prefix_cache_bytes=0, **kw))
    assert engine.serial_reason is None and engine.rows == 4
    assert staggered(engine, prompts, NEW) == expected
    store = engine.row_table.store
    held = [k for k in store.keys if k is not None]
    assert held and all(k.dtype == one.kv_format.storage for k in held)


def test_codec_round_trip_and_sizes():
    x = mx.random.normal((2, 3, 5, 16), key=mx.random.key(1))
    for fmt, tol in (
        (KVFormat("float32", "float16"), 2e-3),
        (KVFormat("float32", "bfloat16"), 2e-2),
    ):
        assert fmt.width(16) == 16 and fmt.decode(fmt.encode(x), 16).dtype == mx.float32
        assert mx.abs(fmt.decode(fmt.encode(x), 16) - x).max().item() < tol
    q8 = KVFormat.of("float32", None, 8, 32)  # a 16-value head padded to one group of 32
    assert q8.width(16) == 8 + 2 and q8.bytes_per_vector(16) == 40 and q8.dim_of(10) == 32
    assert mx.abs(q8.decode(q8.encode(x), 16) - x).max().item() < 0.05
    # the store's zeros (positions never written) decode to zeros
    zeros = mx.zeros((1, 1, 4, q8.width(16)), mx.uint32)
    assert mx.abs(q8.decode(zeros, 16)).max().item() == 0
    # SmolLM2's 64-value heads: float32 256 bytes, float16 128, int8 72, int4 40
    sizes = [KVFormat.of("float32", d, b, None).bytes_per_vector(64) for d, b in
             (("float32", None), ("float16", None), (None, 8), (None, 4))]  # fmt: skip
    assert sizes == [256, 128, 72, 40]
    assert bytes_per_element(4, None, 8, None) * 64 == 72
    assert bytes_per_element(4, "float16", None, None) == 2


def test_settings_refuse_mixed_formats():
    with pytest.raises(ValueError, match="exclusive"):
        EngineSettings(kv_dtype="float16", kv_bits=8)
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        EngineSettings(kv_bits=2)
    with pytest.raises(ValueError, match="quantized KV only"):
        EngineSettings(kv_group_size=32)


def test_default_format_is_the_compute_dtype_and_bytes_per_token(checkpoint):
    path = checkpoint("llama")
    sizes = {}
    for name, kw in {"float32": {}, **FORMATS}.items():
        engine = MLXEngine(path, EngineSettings(rows=1, **kw))
        sizes[name] = engine.kv_token_bytes()
        engine.prefill(0, list(range(3, 40)))
        per_row = engine.row_table.store.nbytes() // engine.row_table.store.capacity
        assert per_row == sizes[name]  # what the store holds is what is reported
    assert sizes["float32"] == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x dim x 4
    assert sizes["float16"] == sizes["bfloat16"] == sizes["float32"] // 2
    assert sizes["int8"] == 2 * 2 * 2 * 40 and sizes["int4"] == 2 * 2 * 2 * 24
    assert MLXEngine(path, EngineSettings(rows=1)).kv_format.identity


@pytest.mark.parametrize("fmt", ["float16", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_drafts_keep_the_output_per_format(fmt, family, checkpoint):
    """Drafts of every accepted/rejected split, verified and rewound beside a plainly
    decoding row: both answers equal the prompts decoded alone in the same format."""
    from tests.engines.test_hybrid_speculation import K, _draft, _greedy, _ids

    path, kw, n = checkpoint(family), FORMATS[fmt], 16
    prompts = [_ids(1, 40), _ids(2, 23)]
    alone = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=0, **kw))
    want = []
    for p in prompts:
        want.append(_greedy(alone, 0, p, n))
        alone.release(0)
    engine = MLXEngine(path, EngineSettings(rows=2, prefix_cache_bytes=0, **kw))
    assert engine.speculative
    got = [[int(np.argmax(engine.prefill(r, p)))] for r, p in enumerate(prompts)]
    step = 0
    while len(got[0]) < n or len(got[1]) < n:
        base = engine.cursor(0)
        draft = _draft(want[0], len(got[0]), step) if len(got[0]) < n else []
        decode = [DecodeRow(0, got[0][-1], tuple(draft))] if len(got[0]) < n else []
        if len(got[1]) < n:
            decode.append(DecodeRow(1, got[1][-1]))
        result = engine.run(StepPlan(decode=tuple(decode)))
        at = dict(zip(result.rows, result.logits, strict=True))
        if 1 in at:
            got[1].append(int(np.argmax(at[1])))
        if 0 in at:
            kept = 0
            for i, logits in enumerate([at[0], *result.verified[0]]):
                got[0].append(int(np.argmax(logits)))
                if i == len(draft) or got[0][-1] != draft[i]:
                    break
                kept += 1
            engine.rewind(0, base + 1 + kept)
        step += 1
    assert K and [g[:n] for g in got] == want


def _score(engine: MLXEngine, prompt: list[int], beside: bool) -> np.ndarray:
    row, parts = engine.rows, []
    for start in range(0, len(prompt), 16):
        chunk = ScoreChunk(1, row, prompt, start, min(start + 16, len(prompt)), 3)
        decode = (DecodeRow(0, 5),) if beside else ()
        parts.append(engine.run(StepPlan(decode=decode, score=(chunk,))).scores[row])
    engine.release(row)
    return np.concatenate([p.token_logprobs for p in parts], axis=1)


@pytest.mark.parametrize("fmt", ["float16", "int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scoring_rows_per_format(fmt, family, checkpoint):
    """Scoring rows in a format: beside a decoding row exactly as alone; within the format's
    rounding of float32 KV's log-probabilities (loose on these random weights, whose
    log-probabilities reach -25; SmolLM2's drift: docs/performance.md)."""
    path = checkpoint(family)
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, 380, 37)]
    ref = MLXEngine(path, EngineSettings(rows=2))
    assert Scorer().attach(ref)
    want = _score(ref, prompt, beside=False)
    engine = MLXEngine(path, EngineSettings(rows=2, **FORMATS[fmt]))
    assert engine.score_rows > 0 and Scorer().attach(engine)
    alone = _score(engine, prompt, beside=False)
    engine.prefill(0, prompt[:12])
    assert np.array_equal(_score(engine, prompt, beside=True), alone)
    assert np.abs(alone - want).max() < {"float16": 1e-2, "int8": 0.25, "int4": 2.0}[fmt]


def test_disk_tier_keeps_formats_apart(checkpoint, tmp_path):
    """A float32 engine and an int8 one on one --prefix-cache-dir: each resumes only its own
    files (fingerprints differ), a file whose header names another format is skipped, and a
    resumed int8 conversation answers what a fresh int8 engine answers."""
    path, folder = checkpoint("llama"), tmp_path / "kv"
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 380, 300)]  # > READ_TOKENS
    answers = {}
    for name, kw in (("float32", {}), ("int8", FORMATS["int8"])):
        settings = EngineSettings(rows=1, prefix_cache_dir=folder, **kw)
        engine = MLXEngine(path, settings)
        answers[name] = _alone(engine, prompt, NEW)
        engine.persist()
        engine.prefix_cache.disk.flush()
    dirs = sorted(p for p in folder.iterdir() if p.is_dir())
    assert len(dirs) == 2
    resumed = MLXEngine(path, EngineSettings(rows=1, prefix_cache_dir=folder, **FORMATS["int8"]))
    tier = resumed.prefix_cache.disk
    assert tier.kv_format == "int8/g32" and tier.stats()["disk_entries"] == 1
    assert resumed.row_table.kept[0]  # read back into the row
    assert _alone(resumed, prompt, NEW) == answers["int8"]
    # a file claiming this fingerprint but another format is never served
    other = DiskTier(folder, 1 << 30, tier.fingerprint, kv_format="float16")
    assert other.stats()["disk_entries"] == 0 and other.corrupt == 1
    with pytest.raises(CorruptEntry):
        other._check_format({"kv": "int8/g32"})


def test_health_reports_the_format_and_the_fingerprint_names_it(checkpoint):
    """Served with --kv-bits 8: /health gives the format and a position's bytes, and
    system_fingerprint differs from float32 KV's (S9: another format, other outputs)."""
    import httpx

    from llm_server.testing.live import serving

    path = checkpoint("qwen3")
    fingerprints = {}
    for name, kw in (("float32", {}), ("int8", FORMATS["int8"])):
        with serving(path, concurrent=2, **kw) as server:
            health = httpx.get(server.url + "/health").json()
            fingerprints[name] = health["system_fingerprint"]
            per = 2 * 2 * 2 * (40 if name == "int8" else 64)
            assert health["kv"] == {
                "format": {"int8": "int8/g32"}.get(name, name),
                "bytes_per_token": per,
            }
    assert fingerprints["float32"] != fingerprints["int8"]


@pytest.mark.parametrize("fmt", ["float16", "int8"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next"])
def test_scheduler_serves_each_format_as_the_engine_alone(fmt, family, checkpoint, prompts):
    """Through the real BatchScheduler (pipelined where the model allows), staggered requests
    that share steps and mix prompt chunks with decode rows answer what each prompt decoded
    alone on an engine of the same format answers (== serial)."""
    from llm_server.tokenizer import Tokenizer
    from tests.scheduler.helpers import make_request, start_scheduler

    path, kw = checkpoint(family), FORMATS[fmt]
    one = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=0, **kw))
    solo = [_alone(one, p, NEW) for p in prompts]
    tok = Tokenizer(path)
    sched = start_scheduler(path, 4, pipeline=True, **kw)
    try:
        outs = []
        for p in prompts:
            req, out = make_request(tok, p, NEW, ignore_eos=True)
            sched.submit(req)
            outs.append(out)
            out.wait_first_token()
        assert all(o.done.wait(60) for o in outs)
        assert sched.max_rows_busy > 1
        assert [o.tokens for o in outs] == solo
    finally:
        sched.close(10)


def test_a_serial_model_keeps_its_kv_in_the_compute_dtype(checkpoint, caplog):
    """A model served on mlx-lm's own caches (llama4) cannot take the format: it says so and
    reports the compute dtype, never a format it does not hold."""
    engine = MLXEngine(checkpoint("llama4"), EngineSettings(rows=2, **FORMATS["int8"]))
    assert engine.serial_reason is not None
    assert engine.kv_format_name == "float32" and engine.kv_format.identity
    assert any("KV in float32, not int8/g32" in r.getMessage() for r in caplog.records)
