"""Linux CPU fast path: preload a fast BLAS so MLX's CPU matmuls are not the reference ones.

mlx's Linux CPU wheel links a reference BLAS (~5 GFLOPS). Entry points call `ensure_fast_blas()`
first, which re-executes the process once with LD_PRELOAD set to Debian's BLIS (`libblis4-pthread`)
or OpenBLAS (`libopenblas0-pthread`). BLIS is preferred when both are installed: its skinny-matrix
kernels skip packing, so the matrix-vector products of decoding run ~1.5x faster than OpenBLAS
0.3.21 (see README "Linux CPU note"); OpenBLAS stays the fallback. LLM_SERVER_BLAS picks one
(`blis`, `openblas`, `off`); LLM_SERVER_NO_BLAS_PRELOAD=1 is the same as `off`. A quick numeric
check after start-up falls back to the other library, once, if the chosen one computes wrong
results (`check_blas`); where nothing was preloaded (macOS) a wrong product is one warning.
In front of the BLAS goes `llm_server.native.skinny`'s library: it computes MLX's row-major
products itself (decoding's few-row products at close to memory speed; each output element
with one arithmetic whatever the batch) and hands other layouts to the BLAS
(LLM_SERVER_SKINNY=0 leaves it out). The same re-exec sets glibc's malloc tunables so the
weights sit in transparent huge pages (`HUGEPAGE_TUNABLES`; LLM_SERVER_HUGEPAGES=0 leaves malloc
as it is).
Preloads nothing on macOS (MLX uses Accelerate and Metal there). On every platform the entry
points set MLX_ENABLE_TF32=0 unless the user set it (`exact_float32`): float32 products in full
precision on hardware with matrix units too (M5, CUDA); /health reports which holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import logging
import os
import sys
from collections.abc import Iterator

from llm_server.native import jit, skinny
from llm_server.native.skinny import mapped_files

CHOICE_ENV = "LLM_SERVER_BLAS"
DISABLE_ENV = "LLM_SERVER_NO_BLAS_PRELOAD"
_REEXEC_ENV = "LLM_SERVER_BLAS_REEXEC"  # "1": preloaded by ensure_fast_blas; "fallback": last try
TF32_ENV = "MLX_ENABLE_TF32"
_LIBRARIES = {
    # libblis.so.4 first: besides the BLAS symbols it exports BLIS's own API, whose runtime
    # thread setter `threads()` uses (libblas.so.3 from the same package exports BLAS only)
    "blis": (
        "/usr/lib/*/blis-pthread/libblis.so.4",
        "/usr/lib/*/blis-pthread/libblas.so.3",
        "/usr/lib64/blis-pthread/libblas.so.3",
    ),
    "openblas": (
        "/usr/lib/*/openblas-pthread/libblas.so.3",
        "/usr/lib/openblas-pthread/libblas.so.3",
        "/usr/lib64/openblas-pthread/libblas.so.3",
    ),
}
PREFERENCE = ("blis", "openblas")
HUGEPAGES_ENV = "LLM_SERVER_HUGEPAGES"  # "0": leave glibc's malloc tunables alone
# Decoding reads every weight once a step, so its speed is the memory's read rate, and that is
# ~15-20% higher from 2 MiB pages than from 4 KiB ones (fewer TLB misses on a 540 MB stream;
# docs/performance.md, "Huge pages and tile shapes"). glibc >= 2.35 (older ones ignore these): `hugetlb=1` advises
# transparent huge pages for what malloc maps, and a fixed 32 MiB mmap threshold (glibc's
# most) serves every weight matrix from malloc's heap, where the pages are 2 MiB whole, rather
# than each from its own mapping, too small or misaligned for one. One arena: the server loads
# the model on a worker thread (its /health answers meanwhile), and a thread's own arena grows
# in 64 MiB heaps that glibc 2.36 does not advise: loaded there, 147 of SmolLM2's 538 MB of
# weights were in huge pages (the embedding, mapped alone), 561 MB with the main arena.
HUGEPAGE_TUNABLES = (
    "glibc.malloc.hugetlb=1",
    "glibc.malloc.mmap_threshold=33554432",
    "glibc.malloc.arena_max=1",
)

log = logging.getLogger(__name__)


def library_path(name: str) -> str | None:
    """Path of Debian's pthread `libblas.so.3` for `name` ('blis' | 'openblas'), if installed."""
    if not sys.platform.startswith("linux"):
        return None
    for pattern in _LIBRARIES[name]:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def chosen_blas(env: dict[str, str] | None = None) -> str | None:
    """The library to preload under `env`: the requested one, else the first installed."""
    env = os.environ if env is None else env
    choice = env.get(CHOICE_ENV, "auto").lower()
    if env.get(DISABLE_ENV) == "1" or choice == "off":
        return None
    names = PREFERENCE if choice == "auto" else (choice,)
    for name in names:
        if name in _LIBRARIES and library_path(name) is not None:
            return name
    return None


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: os.environ) with the chosen BLAS preloaded, when available."""
    env = jit.path_env(dict(os.environ if env is None else env))
    name = chosen_blas(env)
    if name is None:
        return env
    libs = [library_path(name)]
    fast = skinny.build() if skinny.enabled(env) else None
    if fast is not None:
        libs.insert(0, str(fast))  # first: its cblas_sgemm hands large products to the BLAS
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if current[: len(libs)] != libs:
        marks = ("blis", "openblas", "libllm_skinny-")
        others = [p for p in current if not any(k in p for k in marks)]
        env["LD_PRELOAD"] = ":".join([*libs, *others])
    if name == "blis":
        env.setdefault("BLIS_NUM_THREADS", str(os.cpu_count() or 1))
    if env.get(HUGEPAGES_ENV, "1") != "0":
        env["GLIBC_TUNABLES"] = with_tunables(env.get("GLIBC_TUNABLES", ""), HUGEPAGE_TUNABLES)
    return env


def with_tunables(current: str, wanted: tuple[str, ...]) -> str:
    """`current` (GLIBC_TUNABLES' `name=value:...`) with each of `wanted` added unless the
    caller set that name already (theirs wins)."""
    items = [t for t in current.split(":") if t]
    names = {t.split("=", 1)[0] for t in items}
    return ":".join([*items, *(t for t in wanted if t.split("=", 1)[0] not in names)])


def ensure_fast_blas() -> None:
    """Re-exec this process once with the fast BLAS preloaded (Linux only; no-op when active)."""
    exact_float32()  # before MLX's first product (it reads the variable once)
    path = jit.path_env(dict(os.environ)).get("PATH")
    if path is not None:
        os.environ["PATH"] = path  # MLX looks g++ up when it builds a kernel (native.jit)
    name = chosen_blas()
    if name is None or os.environ.get(_REEXEC_ENV):
        return
    env = preload_env()
    if all(env.get(k) == os.environ.get(k) for k in ("LD_PRELOAD", "GLIBC_TUNABLES")) and (
        name != "blis" or "BLIS_NUM_THREADS" in os.environ
    ):
        return  # already preloaded by the caller (make test, the benchmark)
    env[_REEXEC_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def exact_float32(env: dict[str, str] | None = None) -> None:
    """Full-precision float32 products unless the user chose otherwise.

    MLX runs float32 matmul-family ops with TF32-class inputs on hardware with matrix units (the
    M5's GPU, CUDA) while MLX_ENABLE_TF32 is 1, its default; it reads the variable once, at its
    first product. The server's exactness promises (batched == alone, speculation on == off)
    are stated for full float32, so a float32 model gets that unless MLX_ENABLE_TF32 was set.
    bfloat16/float16 models are unaffected (TF32 concerns float32 inputs only).
    """
    (os.environ if env is None else env).setdefault(TF32_ENV, "0")


def float32_precision() -> str:
    """'full' when MLX_ENABLE_TF32=0, else 'tf32' (taken where the hardware has matrix units)."""
    return "full" if os.environ.get(TF32_ENV, "1").strip() == "0" else "tf32"


def check_blas() -> bool:
    """Compare MLX float32 matmuls (skinny and square) with numpy in float64 (rtol 1e-4).

    Wrong products under a BLAS this module preloaded (Linux) re-exec the process once with the
    next library (or none); a process that is already that fallback, or runs without a preloaded
    BLAS (macOS: Accelerate or Metal, where TF32 is the likely cause), logs one warning and goes
    on. Returns True when the products are right.
    """
    wrong = _wrong_product()
    if wrong is None:
        return True
    if _preloaded() and os.environ.get(_REEXEC_ENV) != "fallback":
        _fall_back(wrong)  # does not return
    log.warning(
        "float32 products differ from float64 beyond rtol 1e-4 (%s; BLAS %s, %s=%s): serving "
        "anyway, but outputs may differ from other machines' and batched == alone may not hold",
        wrong,
        active_blas(),
        TF32_ENV,
        os.environ.get(TF32_ENV, "unset"),
    )
    return False


def _wrong_product() -> str | None:
    """The first product shape MLX gets wrong (`MxKxN`), or None."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = ((1, 576, 1536), (4, 576, 1536), (8, 64, 300), (13, 100, 37), (300, 576, 600))
    for m, k, n in shapes:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k)).astype(np.float32)
        for got, want in (
            (mx.array(a) @ mx.array(b).T, a.astype(np.float64) @ b.astype(np.float64).T),
            (mx.array(a) @ mx.array(np.ascontiguousarray(b.T)), a.astype(np.float64) @ b.T),
        ):
            if not np.allclose(np.array(got), want, rtol=1e-4, atol=1e-3 * np.sqrt(k)):
                return f"{m}x{k}x{n} product is wrong"
    return None


def _preloaded() -> bool:
    """True when this process runs with the BLAS `chosen_blas()` names in LD_PRELOAD (Linux)."""
    name = chosen_blas()
    path = library_path(name) if name else None
    return path is not None and path in os.environ.get("LD_PRELOAD", "").split(":")


def _fall_back(reason: str) -> None:
    """Re-exec once with the next installed library, or with none; marked so it is the last."""
    name = chosen_blas()
    rest = [p for p in PREFERENCE if p != name and library_path(p) is not None]
    nxt = rest[0] if rest else "off"
    log.error("BLAS %s computes wrong results (%s); restarting once with %s", name, reason, nxt)
    env = dict(os.environ)
    env[CHOICE_ENV] = nxt
    env[skinny.DISABLE_ENV] = "0"  # the fallback runs the BLAS alone
    env.pop("LD_PRELOAD", None)
    env = preload_env(env)
    env[_REEXEC_ENV] = "fallback"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def active_blas() -> str:
    """Which BLAS this process has mapped: 'accelerate', 'blis (<path>)', 'openblas (<path>)'..."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return "unknown"
    libs = mapped_files(text)
    front = " + skinny products" if any("libllm_skinny-" in p for p in libs) else ""
    for name, marker in (("blis", "blis-pthread"), ("openblas", "openblas-pthread")):
        found = sorted(p for p in libs if marker in p)
        if found:
            return f"{name} ({found[0]}){front}"
    return "reference"


@functools.cache
def _thread_setter():
    """BLIS's `bli_thread_set_num_threads` when BLIS is mapped (the preloaded .so.4), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).bli_thread_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int64], None  # dim_t is a 64-bit int
    return fn


def threads_settable() -> bool:
    """True when the mapped BLAS is BLIS with its runtime thread setter."""
    return _thread_setter() is not None


def default_threads() -> int:
    try:
        return max(1, int(os.environ.get("BLIS_NUM_THREADS", "")))
    except ValueError:
        return os.cpu_count() or 1


def set_threads(n: int) -> None:
    """Set BLIS's thread count for the calls that follow (a no-op unless `threads_settable()`)."""
    setter = _thread_setter()
    if setter is not None:
        setter(n)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run the block with BLIS on `n` threads (a no-op unless `threads_settable()`).

    The decode step splits its products across two MLX streams itself; one BLIS thread per
    stream then beats BLIS forking both cores for every skinny product.
    """
    set_threads(n)
    try:
        yield
    finally:
        set_threads(default_threads())


def _main(argv: list[str]) -> None:
    """`python -m llm_server.native.blas`: print the LD_PRELOAD value; `... CMD ARGS` runs CMD with it."""
    env = preload_env()
    exact_float32(env)  # `make test`: the exactness tests hold in full float32 (M5 included)
    if not argv:
        print(env.get("LD_PRELOAD", ""))
        return
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    _main(sys.argv[1:])
