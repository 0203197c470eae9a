"""MLX's run-time CPU kernels built for this CPU (llm_server/native/jit.py): the same values.

The `g++` wrapper adds jit.FLAGS (-march=native ...). Vector instructions must not change
a fused kernel's values, and contraction into FMAs would (MLX's own ops are built without
it): compiled graphs equal the same ops run eagerly, and equal kernels built without the
wrapper, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from llm_server.native import jit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU only")

# elementwise chains MLX fuses into one run-time kernel: SwiGLU, softmax's exp, RMSNorm, a
# multiply-add (contracted into an FMA by -march=native alone), the rotation
_PROBE = """
import json, sys, numpy as np, mlx.core as mx
x = mx.random.normal((8, 3072), key=mx.random.key(1)) * 3
# the kernels' special cases: exp's clamps at +-88, NaN, infinities, signed zeros, tiny values
edge = [0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 87.9, -87.9, 1e-30, -1e-30, 0.5, -0.5]
edge += [float("nan"), float("inf"), float("-inf")]
x = mx.concatenate([mx.array([edge * 16], dtype=mx.float32), x[1:, : 16 * len(edge)]])
x = mx.concatenate([x, mx.random.normal((8, 3072 - x.shape[1]), key=mx.random.key(4))], 1)
y = mx.random.normal((8, 3072), key=mx.random.key(2))
w = mx.random.normal((3072,), key=mx.random.key(3))
fns = {
    "silu_mul": lambda a, b: a * mx.sigmoid(a) * b,
    "softmax_exp": lambda a, b: mx.exp(a - mx.max(a, axis=-1, keepdims=True)),
    "rms_norm": lambda a, b: a * mx.rsqrt(mx.mean(a * a, axis=-1, keepdims=True) + 1e-5) * w,
    "mul_add": lambda a, b: a * b + a,
    "rotate": lambda a, b: a * mx.cos(b) + b * mx.sin(a),
}
out = {}
for name, f in fns.items():
    eager, compiled = np.array(f(x, y)), np.array(mx.compile(f)(x, y))
    same = np.array_equal(eager, compiled, equal_nan=True)
    out[name] = [bool(same), compiled.tobytes().hex()]
json.dump(out, sys.stdout)
"""


def _probe(folder, native: bool) -> dict:
    """Run the probe with a fresh MLX kernel cache, with or without the wrapper's g++."""
    folder.mkdir()
    env = {**os.environ, "TMPDIR": str(folder)}
    wrapper = str(jit.wrapper_dir() or "")
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != wrapper)
    if native:
        env = jit.path_env(env)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_kernels_built_for_this_cpu_compute_the_same_values(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++: MLX runs its kernels uncompiled")
    native = _probe(tmp_path / "native", native=True)
    plain = _probe(tmp_path / "plain", native=False)
    assert list((tmp_path / "native").glob("mlx/*/cpu/*.so"))  # kernels were built here
    for name, (equal, values) in native.items():
        assert equal, f"{name}: the compiled kernel differs from the eager ops"
        assert values == plain[name][1], f"{name}: -march=native changed its values"


def test_the_wrapper_is_first_in_path_under_the_entry_points():
    """`make test` runs under `python -m llm_server.native.blas`: MLX finds the wrapper's g++."""
    folder = jit.wrapper_dir()
    if folder is None:
        pytest.skip("no g++ on PATH")
    assert shutil.which("g++") == str(folder / "g++")
    script = (folder / "g++").read_text()
    assert jit.FLAGS in script and str(folder) not in script  # calls the real compiler
    assert jit.path_env({"PATH": "/usr/bin", jit.DISABLE_ENV: "0"}) == {
        "PATH": "/usr/bin",
        jit.DISABLE_ENV: "0",
    }


def test_kernels_built_with_other_flags_are_rebuilt(tmp_path):
    """MLX names a cached kernel by its computation alone: kernels built before with other
    flags are removed once (a stamp records the flags), kernels built with these are kept."""
    env = {"TMPDIR": str(tmp_path), "PATH": os.environ["PATH"]}
    folder = jit.kernel_dir(env)
    folder.mkdir(parents=True)
    old = folder / "libold_kernel.so"
    old.write_bytes(b"built without the flags")
    jit.drop_stale_kernels(env)
    assert not old.exists()
    assert (folder / ".llm-server-flags").read_text() == jit.FLAGS
    new = folder / "libnew_kernel.so"
    new.write_bytes(b"built with the flags")
    jit.drop_stale_kernels(env)
    assert new.exists()
    (folder / ".llm-server-flags").write_text("-march=native")
    jit.drop_stale_kernels(env)
    assert not new.exists()
