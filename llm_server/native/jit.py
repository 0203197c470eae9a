"""MLX's CPU kernels compiled for this CPU: a `g++` first in PATH that adds `-march=native`.

MLX fuses elementwise chains of a compiled graph (SiLU·up, the exp of a softmax, RMSNorm,
rotations) into C++ kernels that it builds at run time with `g++ -std=c++17 -O3` from PATH, for
the baseline x86-64 (SSE2, `fmaf` as a library call). Its exp and sigmoid then cost ~13-16 ns
an element, ~12 ms of an 8-row SmolLM2 decode step. Built with `-march=native` the same
kernels run 2-3x faster (exp of a softmax 14.1 -> 5.5 ns, SiLU·up 16.5 -> 8.0) and, with
`-ffp-contract=off` (GCC would otherwise fuse a*b+c into FMAs, which MLX's prebuilt ops do
not), compute bit for bit the same values as the prebuilt ops and as kernels built without
the flags (`tests/test_native_jit.py`), so compiled and eager steps stay equal.

`path_env` puts a directory holding such a `g++` (a two-line shell script calling the real
one) first in PATH; `blas.preload_env` applies it with the BLAS preload. MLX caches built
kernels under `$TMPDIR/mlx/<version>/cpu` by kernel name, so kernels built before stay in use
until that folder is removed. LLM_SERVER_NATIVE_JIT=0 leaves MLX's compiler as it is.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from llm_server.native import skinny

DISABLE_ENV = "LLM_SERVER_NATIVE_JIT"
FLAGS = "-march=native -ffp-contract=off"


def wrapper_dir(env: dict[str, str] | None = None) -> Path | None:
    """The folder with the `g++` wrapper (written when missing), or None where it does not
    apply: not Linux, disabled, or no g++ on PATH."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(DISABLE_ENV, "1") == "0":
        return None
    folder = skinny.cache_dir() / "jit-bin"
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


def path_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the wrapper's folder first in PATH (unchanged where it does not apply)."""
    folder = wrapper_dir(env)
    if folder is None:
        return env
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != str(folder)]
    return {**env, "PATH": os.pathsep.join([str(folder), *rest])}
