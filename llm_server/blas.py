"""Linux CPU fast path: preload Debian's OpenBLAS so MLX's CPU matmuls are ~40x faster.

mlx's Linux CPU wheel links a reference BLAS. Entry points call `ensure_openblas()` first, which
re-executes the process once with LD_PRELOAD set when the library exists. Set
LLM_SERVER_NO_BLAS_PRELOAD=1 to turn it off. Does nothing on macOS (Accelerate is used there).
"""

from __future__ import annotations

import glob
import os
import sys

DISABLE_ENV = "LLM_SERVER_NO_BLAS_PRELOAD"
_REEXEC_ENV = "LLM_SERVER_BLAS_REEXEC"
_PATTERNS = (
    "/usr/lib/*/openblas-pthread/libblas.so.3",
    "/usr/lib/openblas-pthread/libblas.so.3",
    "/usr/lib64/openblas-pthread/libblas.so.3",
)


def openblas_library() -> str | None:
    """Path of Debian's pthread OpenBLAS `libblas.so.3`, or None when not installed."""
    if not sys.platform.startswith("linux"):
        return None
    for pattern in _PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default: os.environ) with the OpenBLAS preload added when available."""
    env = dict(os.environ if env is None else env)
    lib = openblas_library()
    if lib is None or env.get(DISABLE_ENV) == "1":
        return env
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if lib not in current:
        env["LD_PRELOAD"] = ":".join([lib, *current])
    return env


def ensure_openblas() -> None:
    """Re-exec this process once with OpenBLAS preloaded (Linux only; no-op when active)."""
    lib = openblas_library()
    if lib is None or os.environ.get(DISABLE_ENV) == "1" or os.environ.get(_REEXEC_ENV):
        return
    if lib in os.environ.get("LD_PRELOAD", "").split(":"):
        return
    env = preload_env()
    env[_REEXEC_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def active_blas() -> str:
    """Which BLAS this process has mapped: 'accelerate', 'openblas (<path>)' or 'reference'."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:
        return "unknown"
    libs = {line.split()[-1] for line in text.splitlines() if ".so" in line}
    preloaded = sorted(p for p in libs if "openblas-pthread" in p or "libopenblas" in p)
    if preloaded:
        return f"openblas ({preloaded[0]})"
    return "reference"


if __name__ == "__main__":
    # `python -m llm_server.blas` prints the LD_PRELOAD value to use (empty when unavailable).
    print(preload_env().get("LD_PRELOAD", ""))
