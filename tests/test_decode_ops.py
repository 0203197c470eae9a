"""The decode ops (llm_server.native.decode_ops): MLX primitives for a layer's decode attention.

Checked against the plain formula in numpy; the rotation and the written keys bit for bit
against MLX's own rotation; one arithmetic per output whatever the batch, the rows' order or
the thread split; the store written in place when MLX can donate it and copied when not; bad
shapes refused with an error instead of a crash.
"""

from __future__ import annotations

import hashlib
import sys

import mlx.core as mx
import numpy as np
import pytest

from llm_server.engines.forward.layers import Rotation, rotate
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
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    assert MLXEngine(tiny_llama_path, EngineSettings(rows=1)).fused.k.ops is not None
    assert MLXEngine(tiny_model_path, EngineSettings(rows=1)).fused.k.ops is None


@pytest.fixture(scope="module")
def layer_ops():
    from llm_server.native import skinny

    if not skinny.loaded():
        pytest.skip(
            "the skinny library is not preloaded (run under python -m llm_server.native.blas)"
        )
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
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.native import skinny
    from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

    qwen2 = build_tiny_checkpoint(tmp_path / "tiny-qwen2", TinySpec(arch="qwen2"))
    assert MLXEngine(qwen2, EngineSettings(rows=1)).fused.k.whole_layers is False
    llama = MLXEngine(tiny_llama_path, EngineSettings(rows=1)).fused
    assert llama.k.whole_layers == skinny.loaded()


# ---- the attention's one arithmetic, bit for bit (decode_ops.cpp's header says which) ----


def _hashed(seed: int, *shape: int) -> np.ndarray:
    """Floats in [-2, 2) (multiples of 2**-22) from a fixed integer hash (splitmix64): the same
    inputs on every machine and numpy version, so fixed digests of the outputs can be pinned."""
    z = np.arange(int(np.prod(shape)), dtype=np.uint64) + np.uint64(seed << 40)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(40)).astype(np.float32) / np.float32(2**22) - 2).reshape(shape)


def _sum_in_order(terms: np.ndarray, axis: int) -> np.ndarray:
    """0 + t0 + t1 + ... along `axis`, each addition rounded to float32 in that order."""
    zero = np.zeros_like(np.take(terms, [0], axis=axis))
    return np.take(np.add.accumulate(np.concatenate([zero, terms], axis=axis), axis=axis), -1, axis)


def _hsum(
    a: np.ndarray,
) -> np.ndarray:  # [..., 8]: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
    b = a[..., :4] + a[..., 4:]
    c = b[..., :2] + b[..., 2:]
    return c[..., 0] + c[..., 1]


def _exp8(x: np.ndarray) -> np.ndarray:
    """decode_ops.cpp's exp8 step by step in float32 (Cody-Waite, Cephes' polynomial)."""
    f32 = np.float32
    with np.errstate(all="ignore"):
        xc = np.where(x < f32(-87), f32(-87), x)
        t = xc * f32(1.44269504088896341) + f32(0.5)
        f = t.astype(np.int32).astype(np.float32)  # toward zero
        k = np.where(f > t, f - f32(1), f)
        r = xc - k * f32(0.693359375)
        r = r - k * f32(-2.12194440e-4)
        y = np.full_like(r, f32(1.9875691500e-4))
        for c in (
            1.3981999507e-3,
            8.3334519073e-3,
            4.1665795894e-2,
            1.6666665459e-1,
            5.0000001201e-1,
        ):
            y = y * r + f32(c)
        y = y * (r * r) + r + f32(1)
        scale = ((k.astype(np.int32) + 127) << 23).view(np.float32)
        return np.where(x < f32(-87), f32(0), y * scale)


def _exact_attention(qkv, keys, values, rows, pos, cos2, sin2, geometry, scale):
    """attend's outputs from the written stores, each float32 operation in the stated order."""
    heads, kv, dh, q = geometry
    rep, half = heads // kv, dh // 2
    out = np.zeros((len(rows) * q, heads * dh), np.float32)
    for b, (r, p0) in enumerate(zip(rows, pos, strict=True)):
        for i in range(q):
            n, p = b * q + i, p0 + i
            x = qkv[n, : heads * dh].reshape(heads, dh)
            qr = x * cos2[p] + np.concatenate([x[:, half:], x[:, :half]], axis=1) * sin2[p]
            for g in range(kv):
                k, v = keys[r, g, : p + 1], values[r, g, : p + 1]
                prods = (qr[g * rep : (g + 1) * rep, None, :] * k[None]).reshape(rep, p + 1, -1, 8)
                s = _hsum(_sum_in_order(prods, 2)) * np.float32(scale)  # [rep, p + 1]
                s = np.pad(s, ((0, 0), (0, -(p + 1) % 8)), constant_values=-np.inf)
                e = _exp8(s - s.max(axis=1, keepdims=True))
                total = _hsum(_sum_in_order(e.reshape(rep, -1, 8), 1))
                prob = e[:, : p + 1] / total[:, None]
                o = _sum_in_order(prob[:, :, None] * v[None], 1)
                out[n, g * rep * dh : (g + 1) * rep * dh] = o.reshape(-1)
    return out


def _attend_hashed(ops, seed, heads, kv, dh, q, rows, pos, scale, capacity):
    """attend (after write_kv) on hashed inputs: (out, qkv, keys, values, cos2, sin2)."""
    store = (max(rows) + 1, kv, capacity, dh)
    qkv = _hashed(seed, len(rows) * q, (heads + 2 * kv) * dh)
    keys, values = _hashed(seed + 1, *store), _hashed(seed + 2, *store)
    cos2, sin2 = _hashed(seed + 3, capacity, dh) / 2, _hashed(seed + 4, capacity, dh) / 2
    at = (mx.array(rows, dtype=mx.int32), mx.array(pos, dtype=mx.int32), mx.array(cos2))
    geometry = (*at, mx.array(sin2), heads, kv, dh, q)
    k = ops.write_kv(mx.array(keys), mx.array(qkv), *geometry, True)
    v = ops.write_kv(mx.array(values), mx.array(qkv), *geometry, False)
    out = ops.attend(mx.array(qkv), k, v, *geometry, scale)
    mx.eval(out, k, v)
    return np.array(out), qkv, np.array(k), np.array(v), cos2, sin2


@pytest.mark.parametrize(
    "heads, kv, dh, q, rows, pos, scale",
    [
        (9, 3, 64, 1, [0, 1, 2, 3], [0, 7, 1500, 8999], 0.125),  # decode rows, up to 9,000 keys
        (9, 3, 64, 7, [1], [8993], 0.125),  # a short chunk at the end of 9,000
        (9, 3, 64, 33, [0], [480], 1.0),  # a block and one more, scores wide enough to clamp exp
        (8, 2, 128, 32, [0, 1], [0, 300], 0.088),  # rep 4, Dh 128, two rows
        (4, 4, 24, 33, [0], [129], 0.2),  # rep 1, Dh 24 (not a multiple of 16 lanes)
        (3, 1, 8, 2, [0], [9], 0.5),  # Dh 8
    ],
)
def test_attention_is_the_stated_arithmetic_bit_for_bit(ops, heads, kv, dh, q, rows, pos, scale):
    """Every output equals a numpy float32 computation of the header's arithmetic (8-lane dot,
    hsum's tree, exp8, sums in position order) bit for bit: a faster kernel must keep it."""
    capacity = max(pos) + q
    out, qkv, k, v, cos2, sin2 = _attend_hashed(
        ops, q, heads, kv, dh, q, rows, pos, scale, capacity
    )
    want = _exact_attention(qkv, k, v, rows, pos, cos2, sin2, (heads, kv, dh, q), scale)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(
    "heads, kv, dh, q, rows, pos, digest",
    [
        (9, 3, 64, 2048, [0], [0], "70c7aab1b5e395da"),  # SmolLM2: a 2,048-position prompt
        (9, 3, 64, 512, [0], [8488], "b8ee57fa52ff2462"),  # a 512-position chunk up to 9,000 keys
        (12, 3, 128, 100, [1, 0], [3000, 77], "98090df17a2ed3f7"),  # rep 4, Dh 128, two rows
        (6, 6, 40, 65, [0], [1000], "c61498756ec8ea09"),  # rep 1, Dh 40
    ],
)
def test_long_chunks_keep_their_pinned_outputs(ops, heads, kv, dh, q, rows, pos, digest):
    """Chunks too long for the numpy reference: the outputs' sha256 as the arithmetic above
    gave it (pinned before the AVX-512 kernels; any change of a sum's order changes it)."""
    capacity = max(pos) + q
    out = _attend_hashed(ops, 7, heads, kv, dh, q, rows, pos, 0.125, capacity)[0]
    assert hashlib.sha256(out.tobytes()).hexdigest()[:16] == digest
