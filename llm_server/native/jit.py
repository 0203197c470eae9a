"""MLX's CPU kernels compiled for this CPU: a `g++` first in PATH that adds FLAGS.

MLX fuses elementwise chains of a compiled graph (SiLU·up, the exp of a softmax, RMSNorm,
rotations) into C++ kernels that it builds at run time with `g++ -std=c++17 -O3` from PATH, for
the baseline x86-64 (SSE2, `fmaf` as a library call). Its exp and sigmoid then cost ~13-16 ns
an element, ~12 ms of an 8-row SmolLM2 decode step. With `-march=native` they ran 2-3x faster
(exp of a softmax 14.1 -> 5.5 ns, SiLU·up 16.5 -> 8.0), still one element at a time: GCC kept
MLX's exp out of line and would not if-convert its selects. `-fno-trapping-math` and
`-finline-limit=2000` let it inline and vectorize them (SiLU·up 8.0 -> 0.8 ns an element;
an 8-row step 49.5 -> 46.5 ms, a 1-row step 28.3 -> 27.4, medians). None of the flags lets GCC
reorder arithmetic, and `-ffp-contract=off` keeps it from fusing a*b+c into FMAs (MLX's prebuilt
ops do not), so the kernels compute bit for bit the values of the prebuilt ops and of kernels
built without the flags, NaN, infinities and exp's clamps included (`tests/test_native_jit.py`):
compiled and eager steps stay equal.

`path_env` puts a directory holding such a `g++` (a two-line shell script calling the real
one) first in PATH; `blas.preload_env` applies it with the BLAS preload. MLX caches built
kernels under `$TMPDIR/mlx/<version>/cpu` by kernel name, never by flags: a stamp there records
the flags they were built with, and kernels built with others are removed once
(`drop_stale_kernels`). LLM_SERVER_NATIVE_JIT=0 leaves MLX's compiler as it is.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from llm_server.native import skinny

DISABLE_ENV = "LLM_SERVER_NATIVE_JIT"
# the module docstring says why each flag (SiLU·up over [128, 1536]: 1,738 -> 161 us)
FLAGS = "-march=native -ffp-contract=off -fno-trapping-math -finline-limit=2000"


def _folder() -> Path:
    return skinny.cache_dir() / "jit-bin"


def wrapper_dir(env: dict[str, str] | None = None) -> Path | None:
    """The folder with the `g++` wrapper (written when missing), or None where it does not
    apply: not Linux, disabled, or no g++ on PATH."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(DISABLE_ENV, "1") == "0":
        return None
    folder = _folder()
    search = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != str(folder))
    real = shutil.which("g++", path=search)
    if real is None:
        return None
    script = f'#!/bin/sh\nexec {real} {FLAGS} "$@"\n'
    path = folder / "g++"
    try:
        if not path.exists() or path.read_text() != script:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".g++.{os.getpid()}"
            tmp.write_text(script)
            tmp.chmod(0o755)
            os.replace(tmp, path)
    except OSError:
        return None
    return folder


@functools.cache
def active() -> bool:
    """Whether MLX builds its kernels in this process with the wrapper (its `g++` is the first
    on PATH): fused exp and sigmoid then run in vectors and beat a round trip through numpy."""
    found = shutil.which("g++")
    try:
        return found == str(_folder() / "g++") and FLAGS in Path(found).read_text()
    except OSError:
        return False


def kernel_dir(env: dict[str, str]) -> Path:
    """Where MLX caches its built CPU kernels: `std::filesystem::temp_directory_path()`
    (TMPDIR, TMP, TEMP, TEMPDIR, else /tmp) / mlx / version / cpu."""
    tmp = next((env[k] for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if env.get(k)), "/tmp")
    return Path(tmp) / "mlx" / version("mlx") / "cpu"


def drop_stale_kernels(env: dict[str, str]) -> None:
    """Remove the cached kernels when they were built with other flags than FLAGS.

    MLX names a cached kernel by its computation, never by how it was built, so kernels built
    before (by an older wrapper, or without one) would stay in use: the same values, slower.
    A stamp in the folder records the flags; on a change the kernels go and MLX rebuilds each
    on first use (a process that has one loaded keeps its mapping)."""
    folder = kernel_dir(env)
    stamp = folder / ".llm-server-flags"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if stamp.exists() and stamp.read_text() == FLAGS:
            return
        for lib in folder.glob("*.so"):
            lib.unlink(missing_ok=True)
        tmp = folder / f".llm-server-flags.{os.getpid()}"
        tmp.write_text(FLAGS)
        os.replace(tmp, stamp)
    except OSError:
        return


def path_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the wrapper's folder first in PATH (unchanged where it does not apply), and
    MLX's kernels built with other flags removed."""
    folder = wrapper_dir(env)
    if folder is None:
        return env
    drop_stale_kernels(env)
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != str(folder)]
    return {**env, "PATH": os.pathsep.join([str(folder), *rest])}
