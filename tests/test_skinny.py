"""The skinny-product library (llm_server/native): right products, one arithmetic per output.

The library is what MLX's float32 products run on under `make test` on Linux (preloaded in
front of BLIS). What a user relies on: the products are right, and a row's products do not
depend on the rows beside it, so a request's logits are the same alone, batched or beside a
prompt chunk (ARCHITECTURE S10).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from llm_server.native import skinny

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU only")

# (M, N, K): decode-sized and prompt-sized rows, tails in N (% 8, % 16) and K (% 16), tiny K
SHAPES = [
    (1, 1536, 576),
    (1, 37, 100),
    (2, 37, 100),
    (3, 960, 576),
    (6, 64, 40),
    (7, 100, 576),
    (8, 576, 1536),
    (13, 37, 100),
    (40, 9, 3),
    (150, 64, 7),
]


@pytest.fixture(scope="module")
def lib():
    handle = skinny.handle()
    if handle is None:
        pytest.skip("no C compiler, or a CPU without AVX2/AVX-512: the BLAS runs alone")
    return handle


def _product(lib, a, b, trans_b=True, alpha=1.0, beta=0.0, c=None, ld_pad=0):
    """C = alpha * a @ (b.T if trans_b else b) + beta * C through the library; `ld_pad`: extra
    columns in every operand's rows (views into wider buffers, as MLX passes strided rows)."""
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    wide_a = np.zeros((m, k + ld_pad), np.float32)
    wide_a[:, :k] = a
    wide_b = np.zeros((b.shape[0], b.shape[1] + ld_pad), np.float32)
    wide_b[:, : b.shape[1]] = b
    out = np.full((m, n + ld_pad), np.nan, np.float32)
    out[:, :n] = 0 if c is None else c
    lib.llm_skinny_sgemm(
        int(trans_b), m, n, k, alpha, wide_a.ctypes.data, k + ld_pad, wide_b.ctypes.data,
        b.shape[1] + ld_pad, beta, out.ctypes.data, n + ld_pad,
    )  # fmt: skip
    assert np.isnan(out[:, n:]).all()  # nothing written past N
    return out[:, :n]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("trans_b", [True, False])
def test_products_are_right(lib, shape, trans_b):
    m, n, k = shape
    rng = np.random.default_rng(m * 1000 + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    b = w if trans_b else np.ascontiguousarray(w.T)
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    tol = dict(rtol=1e-5, atol=1e-5 * np.sqrt(k))
    np.testing.assert_allclose(_product(lib, a, b, trans_b), want, **tol)
    c = rng.standard_normal((m, n)).astype(np.float32)
    got = _product(lib, a, b, trans_b, alpha=0.5, beta=2.0, c=c, ld_pad=5)
    np.testing.assert_allclose(got, 0.5 * want + 2.0 * c, **tol)


# the one arithmetic per output, written out plainly (compiled for this CPU, as the library)
_REFERENCE_C = r"""
#include <math.h>
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
void reference(int trans_b, int m, int n, int k, float alpha, const float *a, int lda,
               const float *b, int ldb, float beta, float *c, int ldc) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float *x = a + (long)i * lda;
            float s = 0.0f;
            if (trans_b) { /* lane l: k = l, l + VL, ...; lanes halved; the tail in order */
                const float *w = b + (long)j * ldb;
                float lane[VL] = {0};
                int kk = 0;
                for (; kk + VL <= k; kk += VL)
                    for (int l = 0; l < VL; l++) lane[l] = fmaf(x[kk + l], w[kk + l], lane[l]);
                for (int width = VL / 2; width >= 4; width /= 2)
                    for (int l = 0; l < width; l++) lane[l] = lane[l] + lane[l + width];
                s = (lane[0] + lane[2]) + (lane[1] + lane[3]);
                for (; kk < k; kk++) s = fmaf(x[kk], w[kk], s);
            } else {
                for (int kk = 0; kk < k; kk++) s = fmaf(x[kk], b[(long)kk * ldb + j], s);
            }
            float *o = c + (long)i * ldc + j;
            *o = beta == 0.0f ? alpha * s : alpha * s + beta * *o;
        }
}
"""

# (M, N, K): 1-8 rows (decode), 24 rows and up (prompt chunks: weight tiles in L1 where K is
# small, else packed lane-major in tiles of 6 rows, 1-5 rows left over, in blocks of rows), K
# with tails and past 768 (blocks of K), N off every tile and chunk size
EXACT_SHAPES = [
    *[(m, 77, 576) for m in range(1, 9)],
    (5, 200, 1551),
    (23, 70, 100),
    (24, 70, 100),
    (25, 70, 100),
    (28, 100, 200),
    (245, 80, 112),
    (33, 960, 576),
    (33, 77, 1551),
    (128, 576, 1536),
    (128, 200, 1551),
    (300, 37, 40),
    (400, 130, 64),
    (2048, 192, 576),
    (2048, 77, 1551),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    source = folder / "reference.c"
    source.write_text(_REFERENCE_C)
    path = folder / "reference.so"
    flags = ("-O2", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
    if not skinny.compile_to(path, lambda out: ["cc", *flags, "-o", str(out), str(source), "-lm"],
                             "reference", 120):  # fmt: skip
        pytest.skip("no C compiler for the reference")
    ref = ctypes.CDLL(str(path))
    f, p, i = ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    ref.reference.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    return ref


@pytest.mark.parametrize("shape", EXACT_SHAPES)
def test_products_are_the_one_arithmetic_bit_for_bit(lib, reference, shape):
    """Every output equals the plainly written arithmetic (16- or 8-lane FMA sums, the lanes
    halved in vsum's tree, the K % VL tail in order, then alpha and beta) bit for bit, through
    the pool's threads, with and without alpha/beta and strided rows: the tiles, the blocks of
    rows and of K, the vector reductions and the threads change no output."""
    m, n, k = shape
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    a[0, :3], a[-1, -3:] = 0.0, -0.0  # products of zeros: signed zeros follow the same sums
    for trans_b in (True, False):
        b = w if trans_b else np.ascontiguousarray(w.T)
        for alpha, beta, pad in ((1.0, 0.0, 0), (0.5, 2.0, 5), (-1.5, 1.0, 3)):
            c = rng.standard_normal((m, n)).astype(np.float32)
            got = _product(lib, a, b, trans_b, alpha, beta, c, ld_pad=pad)
            want = c.copy()
            reference.reference(
                int(trans_b), m, n, k, alpha, a.ctypes.data, k, b.ctypes.data, b.shape[1],
                beta, want.ctypes.data, n,
            )  # fmt: skip
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("trans_b", [True, False])
def test_a_rows_products_do_not_depend_on_the_rows_beside_it(lib, trans_b):
    """Row i of a 16- to 1100-row product equals the same row alone, in a 2-row and a 5-row
    slice and with the columns cut in two, bit for bit (one row runs in tiles of NB1 weight
    rows, more rows in tiles of up to MT x NB, 18 rows as three of 6 and 27 as 7 + 7 + 7 + 6:
    neither, nor row blocks or threads, change the sums)."""
    rng = np.random.default_rng(7)
    for m, n, k in [
        (16, 1536, 576),
        (16, 3072, 576),
        (18, 960, 576),
        (27, 576, 1536),
        (1100, 96, 576),
    ]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        b = w if trans_b else np.ascontiguousarray(w.T)
        whole = _product(lib, a, b, trans_b)
        for i in (0, 7, m - 1):
            np.testing.assert_array_equal(_product(lib, a[i : i + 1], b, trans_b), whole[i : i + 1])
        np.testing.assert_array_equal(_product(lib, a[3:5], b, trans_b), whole[3:5])
        np.testing.assert_array_equal(_product(lib, a[3:8], b, trans_b), whole[3:8])
        half = n // 2 + 3
        left = _product(lib, a, b[:half] if trans_b else np.ascontiguousarray(b[:, :half]), trans_b)
        np.testing.assert_array_equal(left, whole[:, :half])


def test_products_from_many_threads_at_once_are_each_exact(lib):
    """Six threads call products of different shapes back to back (ctypes lets go of the GIL):
    one holds the pool, the others compute on their own threads, and a worker late for one
    product must never take a chunk of the next. Every result equals its product computed
    alone, bit for bit."""
    rng = np.random.default_rng(11)
    cases = []
    for m, n, k in [(1, 1536, 576), (2, 576, 1536), (1, 4000, 64), (8, 960, 576), (3, 130, 576)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        w = rng.standard_normal((n, k)).astype(np.float32)
        cases.append((a, w, _product(lib, a, w)))
    failures: list[str] = []

    def hammer(seed: int) -> None:
        order = np.random.default_rng(seed).integers(0, len(cases), 60)
        for i in order:
            a, w, want = cases[i]
            if not np.array_equal(_product(lib, a, w), want):
                failures.append(f"thread {seed}: case {i} differs")

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


_POOL_SCRIPT = """
import sys, numpy as np
from llm_server.native import skinny
lib = skinny.handle()
assert lib.llm_skinny_threads() == int(sys.argv[1]), lib.llm_skinny_threads()
rng = np.random.default_rng(5)
for m, n, k in [(1, 49152, 64), (1, 1000, 576), (3, 4099, 100), (20, 960, 576),
                (200, 300, 1551)]:
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    for _ in range(20):
        c = np.full((m, n), np.nan, np.float32)
        lib.llm_skinny_sgemm(1, m, n, k, 1.0, a.ctypes.data, k, w.ctypes.data, k, 0.0,
                             c.ctypes.data, n)
        sys.stdout.buffer.write(c.tobytes())
"""


def test_products_are_the_same_whatever_the_pools_size(lib):
    """Pools of 1, 2 and 7 threads give the same bytes, 20 times over, for products whose
    chunks do not split evenly into the threads' runs. With 7 threads on this machine's cores
    most workers start late, and the others take their runs' chunks from the back: every
    column is computed once, by whichever thread, with the same arithmetic."""
    outputs = []
    for threads in (1, 2, 7):
        env = dict(os.environ, LLM_SERVER_SKINNY_THREADS=str(threads))
        done = subprocess.run(
            [sys.executable, "-c", _POOL_SCRIPT, str(threads)],
            env=env, capture_output=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        outputs.append(np.frombuffer(done.stdout, np.float32))
    assert outputs[0].size == 20 * (49152 + 1000 + 3 * 4099 + 20 * 960 + 200 * 300)
    assert not np.isnan(outputs[0]).any()
    np.testing.assert_array_equal(outputs[1], outputs[0])
    np.testing.assert_array_equal(outputs[2], outputs[0])


def test_mlx_products_in_this_process_take_the_library():
    """Under `make test` MLX's products run on the library: a lone row's product equals its
    row in a batch of 8 and of 200 (a prompt chunk's size), bit for bit. With BLIS alone a
    1-row product sums in another order (ARCHITECTURE S10)."""
    if not skinny.loaded():
        pytest.skip("the skinny library is not preloaded (no compiler, or not Linux)")
    import mlx.core as mx

    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((1536, 576)).astype(np.float32))
    x = mx.array(rng.standard_normal((200, 576)).astype(np.float32))
    alone = np.array(x[5:6] @ w.T)
    np.testing.assert_array_equal(alone, np.array(x[:8] @ w.T)[5:6])
    np.testing.assert_array_equal(alone, np.array(x @ w.T)[5:6])


def test_no_compiler_leaves_the_blas_alone(tmp_path):
    """A failed build (here: no compiler) preloads the BLAS alone and still serves products."""
    from llm_server.native import blas

    if blas.chosen_blas() is None:
        pytest.skip("no BLIS or OpenBLAS installed")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "BLIS_NUM_THREADS")}
    env.update(CC="/nonexistent/cc", LLM_SERVER_CACHE=str(tmp_path))
    code = (
        "from llm_server.native import blas; from llm_server.native import skinny; "
        "assert skinny.build() is None; env = blas.preload_env(); "
        "assert 'libllm_skinny' not in env['LD_PRELOAD'], env['LD_PRELOAD']; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert not list(tmp_path.glob("native/*.so*"))  # no library, no partial file left behind


def test_build_is_cached_per_source_and_machine(lib, tmp_path):
    """The cached build is keyed by source, compiler and CPU: a second build is the same file,
    another compiler setting another one."""
    path = skinny.library_path()
    assert path.exists() and ctypes.CDLL(str(path)).llm_skinny_threads() >= 1
    env = {**os.environ, "LLM_SERVER_CACHE": str(tmp_path), "CC": "cc -DUNUSED_FLAG"}
    code = "from llm_server.native import skinny; print(skinny.build())"
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip().endswith(".so")
    assert runs[0].stdout.strip() != str(path)


def test_a_forked_child_computes_without_the_parents_workers(lib):
    """After fork the pool's workers are gone: the child's products run on its own thread
    (they would wait for the absent workers otherwise)."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((4, 576)).astype(np.float32)
    b = rng.standard_normal((1536, 576)).astype(np.float32)
    want = _product(lib, a, b)  # the parent's pool is running now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when the product is right, killed by the alarm if stuck
        import signal

        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # ends the child even inside C code
        signal.alarm(20)
        os._exit(0 if np.array_equal(_product(lib, a, b), want) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
