"""Decode attention and RMSNorm as MLX primitives on the CPU: their build and the loaded module.

`decode_ops.cpp` adds three ops to MLX (a C++ extension against the installed MLX, bound with
nanobind in MLX's own nanobind domain so that `mx.array`s pass straight through):

- `write_kv(store, qkv, rows, pos, cos2, sin2, heads, kv_heads, head_dim, q, rotate)`: the
  store [R, KV, capacity, Dh] with each row's new keys (rotated) or values written, in place
  when MLX can donate the store;
- `attend(qkv, keys, values, rows, pos, cos2, sin2, heads, kv_heads, head_dim, q, scale)`:
  each new position's rotated query heads over its row's positions 0..p -> [B * q, H * Dh];
- `rms_norm(x, weight, eps)`: `mx.fast.rms_norm`'s values bit for bit (checked at load) as one
  op, where MLX's CPU runs it as a graph of ~4.

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
    import mlx
    import nanobind

    nb = Path(nanobind.__file__).parent
    mlx_dir = Path(mlx.__path__[0])
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
        return path
    if not skinny.compile_to(path, _command, "decode ops", BUILD_TIMEOUT_S):
        return None
    for old in skinny.cache_dir().glob("decode_ops-*"):
        if old != folder:  # an earlier source's build (a process that imported it keeps it)
            for f in old.iterdir():
                f.unlink(missing_ok=True)
            old.rmdir()
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
