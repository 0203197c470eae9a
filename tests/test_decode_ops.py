"""The decode ops (llm_server.native.decode_ops): MLX primitives for a layer's decode attention.

Checked against the plain formula in numpy; the rotation and the written keys bit for bit
against MLX's own rotation; one arithmetic per output whatever the batch, the rows' order or
the thread split; the store written in place when MLX can donate it and copied when not; bad
shapes refused with an error instead of a crash.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.fused_layers import Rotation, rotate
from llm_server.native import decode_ops

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the decode ops are built on Linux only"
)

H, KV, DH = 6, 2, 16


@pytest.fixture(scope="module")
def ops():
    module = decode_ops.module()
    # CI installs nanobind and a compiler: the ops must be in use there, not silently skipped
    assert module is not None, "the decode ops extension did not build or load"
    return module


def _rotation(positions: int) -> Rotation:
    angles = np.random.default_rng(5).random((positions, DH // 2)).astype(np.float32) * 3
    return Rotation.of(mx.array(np.concatenate([np.cos(angles), np.sin(angles)], axis=1)))


def _reference(qkv, keys, values, rows, pos, rot: Rotation, q, scale):
    """The plain formula: rotate, write, softmax(q . k * scale) @ v over positions 0..p."""
    cos2, sin2 = np.array(rot.cos2), np.array(rot.sin2)
    keys, values = keys.copy(), values.copy()

    def rotate(x, p):
        return x * cos2[p] + np.concatenate([x[DH // 2 :], x[: DH // 2]]) * sin2[p]

    for b, (r, p0) in enumerate(zip(rows, pos, strict=True)):
        for i in range(q):
            for g in range(KV):
                keys[r, g, p0 + i] = rotate(qkv[b * q + i, (H + g) * DH : (H + g + 1) * DH], p0 + i)
                values[r, g, p0 + i] = qkv[b * q + i, (H + KV + g) * DH : (H + KV + g + 1) * DH]
    out = np.zeros((len(rows) * q, H * DH), np.float32)
    for b, (r, p0) in enumerate(zip(rows, pos, strict=True)):
        for i in range(q):
            p = p0 + i
            for h in range(H):
                g = h // (H // KV)
                s = keys[r, g, : p + 1] @ rotate(qkv[b * q + i, h * DH : (h + 1) * DH], p) * scale
                e = np.exp(s - s.max())
                out[b * q + i, h * DH : (h + 1) * DH] = (e / e.sum()) @ values[r, g, : p + 1]
    return out, keys, values


def _run(ops, qkv, keys, values, rows, pos, rot, q, scale=0.25):
    rows_a, pos_a = mx.array(rows, dtype=mx.int32), mx.array(pos, dtype=mx.int32)
    geometry = (rows_a, pos_a, rot.cos2, rot.sin2, H, KV, DH, q)
    k = ops.write_kv(mx.array(keys), mx.array(qkv), *geometry, True)
    v = ops.write_kv(mx.array(values), mx.array(qkv), *geometry, False)
    out = ops.attend(mx.array(qkv), k, v, *geometry, scale)
    mx.eval(out, k, v)
    return np.array(out), np.array(k), np.array(v)


def _inputs(rng, store_rows, capacity, n):
    keys = rng.standard_normal((store_rows, KV, capacity, DH)).astype(np.float32)
    values = rng.standard_normal((store_rows, KV, capacity, DH)).astype(np.float32)
    qkv = rng.standard_normal((n, (H + 2 * KV) * DH)).astype(np.float32)
    return qkv, keys, values


def test_a_prompt_chunks_positions_attend_as_each_would_alone(ops):
    """Two rows' 100-position prompt chunks at positions 900 and 37 (attention threaded, each
    row's positions in blocks spread over the threads): every position's output equals the
    same position attended alone (q = 1 after the chunk's keys are written), bit for bit."""
    rng = np.random.default_rng(21)
    q, rows, pos = 100, [1, 0], [900, 37]
    rot = _rotation(1000)
    qkv, keys, values = _inputs(rng, 2, 1000, len(rows) * q)
    out, k, v = _run(ops, qkv, keys, values, rows, pos, rot, q)

    def geometry(r: int, p: int) -> tuple:  # one position of store row r, at p
        return (mx.array([r], dtype=mx.int32), mx.array([p], dtype=mx.int32), rot.cos2,
                rot.sin2, H, KV, DH, 1)  # fmt: skip

    k, v = mx.array(k), mx.array(v)
    for b, (r, p0) in enumerate(zip(rows, pos, strict=True)):
        for i in (0, 31, 32, 33, 63, 64, 99):
            alone = ops.attend(
                mx.array(qkv[b * q + i : b * q + i + 1]), k, v, *geometry(r, p0 + i), 0.25
            )
            np.testing.assert_array_equal(np.array(alone)[0], out[b * q + i])
    want = _reference(qkv, keys, values, rows, pos, rot, q, 0.25)[0]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "q, rows, pos",
    [(1, [2, 0], [5, 30]), (3, [1], [10]), (1, [0, 1, 2], [0, 7, 36]), (2, [2, 1], [0, 4])],
)
def test_attention_and_writes_match_the_formula(ops, q, rows, pos):
    """Scattered store rows at their own positions, one or several new positions per row (a
    draft being verified sees its own earlier positions): the attention within float32
    rounding, and the written keys and values exactly, MLX's rotation included."""
    rng = np.random.default_rng(q + len(rows))
    rot = _rotation(48)
    qkv, keys, values = _inputs(rng, 3, 40, len(rows) * q)
    out, k, v = _run(ops, qkv, keys, values, rows, pos, rot, q)
    want, want_k, want_v = _reference(qkv, keys, values, rows, pos, rot, q, 0.25)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(v, want_v)
    np.testing.assert_array_equal(k, want_k)
    # the keys as MLX's own rotation (the compiled step's graph path) computes them
    x = mx.array(qkv[:q, H * DH : (H + 1) * DH].reshape(1, 1, q, DH))
    p = mx.array([pos[0] + i for i in range(q)])
    cos2, sin2 = rot.cos2[p][None, None], rot.sin2[p][None, None]
    mlx_keys = np.array(rotate(x, cos2, sin2))[0, 0]
    np.testing.assert_array_equal(k[rows[0], 0, pos[0] : pos[0] + q], mlx_keys)


def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(ops):
    """Row 4's output alone (one thread: little work) and beside 23 long rows (enough work for
    the thread pool), in another order: bit for bit the same; the other rows alike."""
    rng = np.random.default_rng(3)
    rot = _rotation(400)
    qkv, keys, values = _inputs(rng, 24, 400, 24)
    pos = rng.integers(250, 390, 24).tolist()
    rows = list(range(24))
    order = rng.permutation(24).tolist()
    batched, _, _ = _run(ops, qkv, keys, values, rows, pos, rot, 1)
    shuffled, _, _ = _run(ops, qkv[order], keys, values, order, [pos[r] for r in order], rot, 1)
    np.testing.assert_array_equal(shuffled, batched[order])
    for r in (4, 17):
        alone, _, _ = _run(ops, qkv[r : r + 1], keys, values, [r], [pos[r]], rot, 1)
        np.testing.assert_array_equal(alone[0], batched[r])


def test_the_store_is_written_in_place_only_when_nothing_else_holds_it(ops):
    """A store only the graph holds is updated in its own buffer (no copy per layer and step);
    a store the caller still holds keeps its contents."""
    rng = np.random.default_rng(8)
    rot = _rotation(16)
    qkv, keys, _ = _inputs(rng, 2, 16, 1)
    rows, pos = mx.array([1], dtype=mx.int32), mx.array([3], dtype=mx.int32)
    geometry = (rows, pos, rot.cos2, rot.sin2, H, KV, DH, 1)

    def address(a):
        return np.asarray(a).__array_interface__["data"][0]

    held = mx.array(keys)
    out = ops.write_kv(held, mx.array(qkv), *geometry, True)
    mx.eval(out)
    assert address(out) != address(held)
    np.testing.assert_array_equal(np.array(held), keys)  # untouched
    before = address(out)
    again = ops.write_kv(out, mx.array(qkv), *geometry, True)
    del out  # only the graph holds it now
    mx.eval(again)
    assert address(again) == before


@pytest.mark.parametrize(
    "change, message",
    [
        ({"qkv": mx.zeros((1, 7))}, "qkv must be"),
        ({"keys": mx.zeros((2, KV + 1, 16, DH))}, "a store must be"),
        ({"rows": mx.array([0, 1], dtype=mx.int32)}, "rows and pos"),
        (
            {"rows": mx.array([0, 1], dtype=mx.int32), "pos": mx.array([1, 2], dtype=mx.int32)},
            "qkv must be",
        ),
        ({"pos": mx.array([0.0])}, "rows and pos"),
        ({"keys": mx.zeros((2, KV, 16, DH), dtype=mx.float16)}, "float32 only"),
    ],
)
def test_bad_shapes_are_refused(ops, change, message):
    rot = _rotation(16)
    args = {
        "qkv": mx.zeros((1, (H + 2 * KV) * DH)),
        "keys": mx.zeros((2, KV, 16, DH)),
        "rows": mx.array([0], dtype=mx.int32),
        "pos": mx.array([1], dtype=mx.int32),
    } | change
    with pytest.raises(ValueError, match=message):
        ops.write_kv(
            args["keys"], args["qkv"], args["rows"], args["pos"], rot.cos2, rot.sin2,
            H, KV, DH, 1, True,
        )  # fmt: skip


@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (33, 960)])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_equals_mlx_bit_for_bit(ops, rows, dim, eps):
    """The compiled step norms with the op where the eager forward runs mx.fast.rms_norm."""
    rng = np.random.default_rng(rows * dim)
    x = rng.standard_normal((rows, dim)) * np.exp(rng.uniform(-8, 8, (rows, 1)))
    x, w = mx.array(x.astype(np.float32)), mx.array(rng.standard_normal(dim).astype(np.float32))
    assert np.array_equal(np.array(ops.rms_norm(x, w, eps)), mx.fast.rms_norm(x, w, eps))
    # a strided view (every other column of a wider array) reads the same values
    wide = mx.repeat(x, 2, axis=1)[:, ::2]
    assert np.array_equal(np.array(ops.rms_norm(wide, w, eps)), mx.fast.rms_norm(x, w, eps))


@pytest.mark.parametrize(
    "x, w",
    [
        (mx.zeros((2, 8)), mx.zeros((7,))),
        (mx.zeros((2, 3, 8)), mx.zeros((8,))),
        (mx.zeros((2, 8), dtype=mx.float16), mx.zeros((8,), dtype=mx.float16)),
    ],
)
def test_rms_norm_refuses_bad_shapes(ops, x, w):
    with pytest.raises(ValueError, match="rms_norm takes float32"):
        ops.rms_norm(x, w, 1e-5)


def test_the_engine_uses_them_where_they_apply(tiny_llama_path, tiny_model_path):
    """A llama layout decodes with the ops; a layout with q/k norms (qwen3) keeps MLX's ops."""
    from llm_server.engines.mlx_engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    assert MLXEngine(tiny_llama_path, EngineSettings(rows=1)).fused.ops is not None
    assert MLXEngine(tiny_model_path, EngineSettings(rows=1)).fused.ops is None


@pytest.fixture(scope="module")
def layer_ops():
    from llm_server.native import skinny

    if not skinny.loaded():
        pytest.skip("the skinny library is not preloaded (run under python -m llm_server.blas)")
    module = decode_ops.layer_module()
    assert module is not None, "the whole-layer decode ops failed their check"
    return module


@pytest.mark.parametrize(
    "dim, heads, kv, dh, inter, rows, pos, store_rows",
    [
        (64, 4, 2, 16, 96, [0], [0], 1),  # one row, its first position
        (64, 4, 2, 16, 96, [3, 1, 0], [9, 0, 30], 4),  # scattered rows, another left alone
        (96, 6, 2, 32, 201, [1, 0], [17, 5], 2),  # odd intermediate size: K tails
        (72, 3, 3, 8, 100, [0, 1, 2, 3, 4], [1, 2, 3, 4, 5], 5),  # no grouping, head_dim 8
    ],
)
def test_whole_layers_equal_the_separate_ops(
    layer_ops, dim, heads, kv, dh, inter, rows, pos, store_rows
):
    """norm_product + write_kv x2 + layer_rest give the compiled step's eleven ops' values bit
    for bit: the layer's output and both stores, for two steps in a row (the second reads the
    first's keys)."""
    layer = decode_ops.random_layer(dim + len(rows), dim, heads, kv, dh, inter)
    rng = np.random.default_rng(dim)
    x = mx.array(rng.standard_normal((len(rows), dim)).astype(np.float32))
    shape = (store_rows, kv, 40, dh)
    keys, values = (mx.array(rng.standard_normal(shape).astype(np.float32)) for _ in "kv")
    angles = rng.random((48, dh // 2)).astype(np.float32) * 3
    rot = Rotation.of(mx.array(np.concatenate([np.cos(angles), np.sin(angles)], axis=1)))
    whole = (x, keys, values)
    separate = (x, keys, values)
    for step in range(2):
        at = (mx.array(rows, dtype=mx.int32), mx.array([p + step for p in pos], dtype=mx.int32))
        whole = decode_ops.whole_layer(layer_ops, layer, *whole, *at, rot.cos2, rot.sin2)
        separate = decode_ops.separate_layer(layer_ops, layer, *separate, *at, rot.cos2, rot.sin2)
        mx.eval(*whole, *separate)
        for got, want in zip(whole, separate, strict=True):
            np.testing.assert_array_equal(np.array(got), np.array(want))
    # the layer did change x and write the stores (not an identity on both sides)
    assert not np.array_equal(np.array(whole[0]), np.array(x))
    assert not np.array_equal(np.array(whole[1]), np.array(keys))
    # weights given as views, as MLX's matmul reads them: a transposed one (b = w.T
    # row-contiguous) and a strided one (copied first)
    layer.down.weight = mx.array(np.array(layer.down.weight).T.copy()).T
    layer.o.weight = mx.repeat(layer.o.weight, 2, axis=1)[:, ::2]
    strided = decode_ops.whole_layer(layer_ops, layer, x, keys, values, *at, rot.cos2, rot.sin2)
    again = decode_ops.separate_layer(layer_ops, layer, x, keys, values, *at, rot.cos2, rot.sin2)
    np.testing.assert_array_equal(np.array(strided[0]), np.array(again[0]))


def test_whole_layer_ops_refuse_bad_shapes(layer_ops):
    layer = decode_ops.random_layer(3, 64, 4, 2, 16, 96)
    x = mx.zeros((1, 64))
    rows, pos = mx.array([0], dtype=mx.int32), mx.array([1], dtype=mx.int32)
    rot = _rotation(16)
    store = mx.zeros((1, 2, 16, 16))
    with pytest.raises(ValueError, match="weight must be a float32 weight"):
        layer_ops.norm_product(x, layer.norm_in.weight, mx.zeros((8, 63)), 1e-5)
    with pytest.raises(ValueError, match=r"x must be float32 \[B, dim\]"):
        layer_ops.norm_product(mx.zeros((1, 1, 64)), layer.norm_in.weight, layer.qkv.weight, 1e-5)
    qkv = layer_ops.norm_product(x, layer.norm_in.weight, layer.qkv.weight, 1e-5)
    good = (layer.o.weight, layer.norm_post.weight, layer.gate_up.weight, layer.down.weight)
    for i, bad, message in [
        (0, mx.zeros((64, 63)), "o must be"),
        (2, mx.zeros((192, 63)), "gate_up must be"),
        (3, mx.zeros((63, 96)), "o and down must give"),
        (3, mx.zeros((64, 96), dtype=mx.float16), "down must be"),
    ]:
        weights = list(good)
        weights[i] = bad
        with pytest.raises(ValueError, match=message):
            layer_ops.layer_rest(
                x, qkv, store, store, rows, pos, rot.cos2, rot.sin2, *weights, 4, 2, 16,
                1e-5, 0.25,
            )  # fmt: skip


def test_the_engine_runs_whole_layers_where_they_apply(tiny_llama_path, tmp_path):
    """Compiled steps of a llama layout run whole layers when the skinny library is preloaded;
    biased projections (qwen2) keep the separate ops."""
    from llm_server.engines.mlx_engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.native import skinny
    from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

    qwen2 = build_tiny_checkpoint(tmp_path / "tiny-qwen2", TinySpec(arch="qwen2"))
    assert MLXEngine(qwen2, EngineSettings(rows=1)).fused.whole_layers is False
    llama = MLXEngine(tiny_llama_path, EngineSettings(rows=1)).fused
    assert llama.whole_layers == skinny.loaded()
