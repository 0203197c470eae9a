"""Decode attention and RMSNorm as MLX primitives on the CPU: their build and the loaded module.

`decode_ops.cpp` adds three ops to MLX (a C++ extension against the installed MLX, bound with
nanobind in MLX's own nanobind domain so that `mx.array`s pass straight through):

- `write_kv(store, qkv, rows, pos, cos2, sin2, heads, kv_heads, head_dim, q, rotate)`: the
  store [R, KV, capacity, Dh] with each row's new keys (rotated) or values written, in place
  when MLX can donate the store;
- `attend(qkv, keys, values, rows, pos, cos2, sin2, heads, kv_heads, head_dim, q, scale)`:
  each new position's rotated query heads over its row's positions 0..p -> [B * q, H * Dh];
- `rms_norm(x, weight, eps)`: `mx.fast.rms_norm`'s values bit for bit (checked at load) as one
  op, where MLX's CPU runs it as a graph of ~4;
- `norm_product(x, norm, weight, eps)` -> rms_norm(x) @ weight.T, and `layer_rest(x, qkv, keys,
  values, rows, pos, cos2, sin2, o, norm_post, gate_up, down, heads, kv_heads, head_dim, eps,
  scale)` -> the layer's output once its keys and values are written (attention, o, the MLP and
  both residuals): with the two `write_kv` a decode layer in four ops where the compiled step
  ran eleven. Products go through the skinny library's function (preloaded; `layer_ready()`),
  and `layer_module()` uses them only where they equal the separate ops bit for bit
  (`_check_layer`).

They replace the ~22 graph ops of a layer's decode attention (slices, the rotation, the store
writes and reads, the grouped products, the mask and the softmax) with three, each computing one
fixed arithmetic per output whatever the batch (the C++ file says which), so every decode
position, of a compiled step, a mixed step or a draft being verified, attends alike (S10).

The extension is compiled here once per source, MLX, nanobind, Python and CPU with the system
C++ compiler (`$CXX`, else `g++`) into the cache folder (~15 s on 2 cores; `make install` does
it ahead), then imported and checked on a small input. No compiler, no nanobind, a failed build
or check, a non-CPU device or LLM_SERVER_DECODE_OPS=0 leave the decode attention in MLX ops:
slower steps, the same server. Linux only: on macOS MLX runs decoding on Metal.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from llm_server.native import skinny

DISABLE_ENV = "LLM_SERVER_DECODE_OPS"  # "0": keep decode attention in MLX ops
MODULE = "_llm_decode_ops"
SOURCE = Path(__file__).with_name("decode_ops.cpp")
# NB_DOMAIN: MLX binds mx.array in nanobind's "mlx" domain; the ops must join it to take arrays.
# -ffp-contract=off: no a*b+c fused into an FMA (the rotation must round as MLX's does)
FLAGS = (
    "-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared",
    "-fvisibility=hidden", "-DNB_DOMAIN=mlx", "-DNDEBUG",
)  # fmt: skip
BUILD_TIMEOUT_S = 300

log = logging.getLogger(__name__)


def enabled(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return sys.platform.startswith("linux") and env.get(DISABLE_ENV, "1") != "0"


def _versions() -> tuple[str, str] | None:
    try:
        return version("mlx"), version("nanobind")
    except PackageNotFoundError:
        return None


def _folder() -> Path | None:
    """Where this source, MLX, nanobind, Python, compiler and CPU's build lives."""
    versions = _versions()
    if versions is None:
        return None
    cxx = os.environ.get("CXX", "g++")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = "\n".join([SOURCE.read_text(), *versions, cxx, *FLAGS, suffix, skinny.cpu_flags()])
    return skinny.cache_dir() / f"decode_ops-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _command(out: Path) -> list[str]:
    import mlx.core
    import nanobind

    nb = Path(nanobind.__file__).parent
    # the installed package's folder: `mlx` is a namespace package, so an `mlx` folder in the
    # working directory (MLX's own CPU JIT cache, /tmp/mlx/<version>/cpu, run from /tmp) would
    # come first in mlx.__path__, and the build would look for the headers there
    mlx_dir = Path(mlx.core.__file__).parent
    return [
        *shlex.split(os.environ.get("CXX", "g++")),
        *FLAGS,
        f"-I{nb / 'include'}",
        f"-I{nb / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{mlx_dir / 'include'}",
        str(nb / "src" / "nb_combined.cpp"),
        str(SOURCE),
        f"-L{mlx_dir / 'lib'}",
        "-lmlx",
        f"-Wl,-rpath,{mlx_dir / 'lib'}",
        "-o",
        str(out),
    ]


@functools.cache
def build() -> Path | None:
    """The built extension, compiling it first when missing; None when it cannot be built."""
    if not enabled():
        return None
    folder = _folder()
    if folder is None:
        log.info("decode ops not built: nanobind is not installed")
        return None
    path = folder / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if path.exists():
        skinny.touch(folder)
        return path
    if not skinny.compile_to(path, _command, "decode ops", BUILD_TIMEOUT_S):
        return None
    for old in skinny.stale_builds(skinny.cache_dir().glob("decode_ops-*"), keep=folder):
        shutil.rmtree(old, ignore_errors=True)
    return path


def _check(ops) -> None:
    """One write and one attention on a tiny store against the plain formula: raises if the
    module cannot take MLX's arrays (another nanobind ABI) or computes something else."""
    import mlx.core as mx
    import numpy as np

    heads, kv, dh = 2, 1, 8
    width = (heads + 2 * kv) * dh
    qkv = mx.arange(width, dtype=mx.float32).reshape(1, width) / width
    store = mx.zeros((1, kv, 2, dh))
    rows, pos = mx.array([0], dtype=mx.int32), mx.array([1], dtype=mx.int32)
    ones, zeros = mx.ones((2, dh)), mx.zeros((2, dh))  # no rotation
    keys = ops.write_kv(store, qkv, rows, pos, ones, zeros, heads, kv, dh, 1, True)
    values = ops.write_kv(store, qkv, rows, pos, ones, zeros, heads, kv, dh, 1, False)
    out = ops.attend(qkv, keys, values, rows, pos, ones, zeros, heads, kv, dh, 1, 0.5)
    x = np.arange(width, dtype=np.float32) / width
    k1, v1 = x[heads * dh : (heads + 1) * dh], x[(heads + 1) * dh :]
    want = []
    for h in range(heads):
        s = np.array([0.0, x[h * dh : h * dh + dh] @ k1]) * 0.5  # position 0: the zero key
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        want.append(p[1] * v1)  # position 0's value is the zero row
    if not np.allclose(np.array(out), np.concatenate(want)[None], atol=1e-6):
        raise RuntimeError("decode ops computed a wrong attention")
    # rms_norm must equal MLX's own bit for bit (the compiled step uses it where the eager
    # forward runs mx.fast.rms_norm): rows of very different scales
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 576)) * np.exp(rng.uniform(-6, 6, (32, 1)))
    x, w = mx.array(x.astype(np.float32)), mx.array(rng.standard_normal(576).astype(np.float32))
    for eps in (1e-5, 1e-6):
        if not np.array_equal(np.array(ops.rms_norm(x, w, eps)), mx.fast.rms_norm(x, w, eps)):
            raise RuntimeError("decode ops' rms_norm differs from mx.fast.rms_norm")


def whole_layer(ops, layer, x, keys, values, rows, pos, cos2, sin2):
    """x [B, dim] through a decode layer (one new position per row) as four ops: norm_product,
    write_kv twice, layer_rest -> (x', keys', values').

    `layer`: norm_in, norm_post (`.weight`, `.eps`), qkv, o, gate_up, down (`.weight` [out,
    in]), heads, kv_heads, head_dim, scale (a fused_layers.Layer); rows, pos int32 [B]."""
    qkv = ops.norm_product(x, layer.norm_in.weight, layer.qkv.weight, layer.norm_in.eps)
    geometry = (rows, pos, cos2, sin2, layer.heads, layer.kv_heads, layer.head_dim)
    keys = ops.write_kv(keys, qkv, *geometry, 1, True)
    values = ops.write_kv(values, qkv, *geometry, 1, False)
    weights = (layer.o.weight, layer.norm_post.weight, layer.gate_up.weight, layer.down.weight)
    x = ops.layer_rest(
        x, qkv, keys, values, *geometry[:4], *weights, *geometry[4:], layer.norm_post.eps,
        layer.scale,
    )  # fmt: skip
    return x, keys, values


def separate_layer(ops, layer, x, keys, values, rows, pos, cos2, sin2):
    """`whole_layer` as the compiled step's ops without norm_product and layer_rest
    (the forward's ops for a decode layer): eleven ops, the values `whole_layer` must equal bit for bit."""
    import mlx.core as mx

    from llm_server.native.cpu_kernels import silu_mul

    qkv = ops.rms_norm(x, layer.norm_in.weight, layer.norm_in.eps) @ layer.qkv.weight.T
    geometry = (rows, pos, cos2, sin2, layer.heads, layer.kv_heads, layer.head_dim, 1)
    keys = ops.write_kv(keys, qkv, *geometry, True)
    values = ops.write_kv(values, qkv, *geometry, False)
    h = mx.addmm(x, ops.attend(qkv, keys, values, *geometry, layer.scale), layer.o.weight.T)
    normed = ops.rms_norm(h, layer.norm_post.weight, layer.norm_post.eps)
    gate, up = mx.split(normed @ layer.gate_up.weight.T, 2, axis=-1)
    return mx.addmm(h, silu_mul(gate, up), layer.down.weight.T), keys, values


def random_layer(seed: int, dim: int, heads: int, kv_heads: int, head_dim: int, inter: int):
    """A decode layer of random float32 weights for the checks (gates of about -60 to 60,
    into the SiLU's saturated ends)."""
    from types import SimpleNamespace

    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)

    def rand(*shape, scale=1.0):
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    def norm(eps):
        return SimpleNamespace(weight=rand(dim), eps=eps)

    def linear(out, inp, scale):
        return SimpleNamespace(weight=rand(out, inp, scale=scale))

    return SimpleNamespace(
        norm_in=norm(1e-5),
        qkv=linear((heads + 2 * kv_heads) * head_dim, dim, 0.2),
        o=linear(dim, heads * head_dim, 0.2),
        norm_post=norm(1e-6),
        gate_up=linear(2 * inter, dim, 2.0),
        down=linear(dim, inter, 0.1),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
    )


def _check_layer(ops) -> None:
    """One decode layer (3 rows of a 4-row store) as `whole_layer` against `separate_layer`:
    raises unless equal bit for bit."""
    import mlx.core as mx
    import numpy as np

    layer = random_layer(1, dim=64, heads=4, kv_heads=2, head_dim=16, inter=96)
    rng = np.random.default_rng(2)
    x = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    keys, values = (mx.array(rng.standard_normal((4, 2, 8, 16)).astype(np.float32)) for _ in "kv")
    rows, pos = mx.array([2, 0, 3], dtype=mx.int32), mx.array([0, 3, 7], dtype=mx.int32)
    angles = np.arange(8)[:, None] * np.linspace(0.1, 1.0, 8)[None]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos2 = mx.array(np.concatenate([cos, cos], -1))
    sin2 = mx.array(np.concatenate([-sin, sin], -1))
    args = (x, keys, values, rows, pos, cos2, sin2)
    got, want = whole_layer(ops, layer, *args), separate_layer(ops, layer, *args)
    mx.eval(*got, *want)
    for name, a, b in zip(("x", "keys", "values"), got, want, strict=True):
        if not np.array_equal(np.array(a), np.array(b)):
            raise RuntimeError(f"the whole-layer decode ops' {name} differs from the separate ops")


@functools.cache
def layer_module():
    """The decode ops when their `norm_product` and `layer_rest` may run a decode step's
    layers (the skinny library is preloaded and they equal the separate ops bit for bit), else
    None."""
    ops = module()
    if ops is None or not ops.layer_ready():
        return None
    try:
        _check_layer(ops)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the separate ops
        log.warning("decode ops not used for whole layers: %s", exc)
        return None
    return ops


@functools.cache
def module():
    """The loaded and checked extension, or None (then decode attention stays in MLX ops)."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return None
    path = build()
    if path is None:
        return None
    try:
        spec = importlib.util.spec_from_file_location(MODULE, path)
        ops = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ops)
        _check(ops)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the MLX ops
        log.warning("decode ops not used: %s", exc)
        return None
    return ops


if __name__ == "__main__":  # `make install` builds the extension ahead of the first engine
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ops = module()
    print(f"decode ops: {ops.__file__}" if ops is not None else "decode ops: not in use")
