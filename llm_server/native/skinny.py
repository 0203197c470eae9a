"""The skinny-product library: its build, its path, and a ctypes handle for tests.

`skinny_sgemm.c` exports `cblas_sgemm` and computes MLX's row-major float32 products itself
(fastest where decoding needs it, on products of a few rows, and with one arithmetic per
output element whatever the batch), handing other layouts to the BLAS preloaded after it (see
the C file). It is compiled here, once per source and machine, with the system C compiler
(`$CC`, else `cc`) into the cache folder, and `blas.preload_env` puts it first in LD_PRELOAD.
No compiler, a failed build or LLM_SERVER_SKINNY=0 leave the BLAS alone: slower decoding, the
same server. Linux only (on macOS MLX runs its products on Metal or Accelerate).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DISABLE_ENV = "LLM_SERVER_SKINNY"  # "0": do not preload the library
# (its thread count: LLM_SERVER_SKINNY_THREADS, else BLIS_NUM_THREADS, else the CPU count)
SOURCE = Path(__file__).with_name("skinny_sgemm.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Wno-psabi")
LIBS = ("-lpthread", "-lm", "-ldl")
BUILD_TIMEOUT_S = 120
STALE_AFTER_S = 24 * 3600  # another source's build goes once unused this long and unmapped

log = logging.getLogger(__name__)


def enabled(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return sys.platform.startswith("linux") and env.get(DISABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    root = os.environ.get("LLM_SERVER_CACHE")
    if root:
        return Path(root).expanduser() / "native"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "llm-server" / "native"


def cpu_flags() -> str:
    """The CPU's feature flags: `-march=native` builds for them, so they are part of the key."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where this source, compiler and CPU's build lives (it may not exist yet)."""
    cc = os.environ.get("CC", "cc")
    key = "\n".join([SOURCE.read_text(), cc, *FLAGS, platform.machine(), cpu_flags()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / f"libllm_skinny-{digest}.so"


def compile_to(path: Path, command, what: str, timeout_s: float) -> bool:
    """Run `command(out)` (a compiler call writing `out`) into a temporary file beside `path`,
    then move it to `path` (atomic: concurrent builders each leave a whole file). False, with
    the compiler's complaint logged, when it fails."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so.part", dir=path.parent)
        os.close(fd)
        cmd = command(Path(tmp))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            log.warning("%s not built (%s): %s", what, " ".join(cmd), done.stderr[-2000:])
            return False
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("%s not built: %s", what, exc)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return True


@functools.cache
def build() -> Path | None:
    """The built library, compiling it first when missing; None when it cannot be built."""
    if not sys.platform.startswith("linux"):
        return None
    path = library_path()
    if path.exists():
        touch(path)
        return path
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not compile_to(
        path,
        lambda out: [*cc, *FLAGS, "-o", str(out), str(SOURCE), *LIBS],
        "skinny products",
        BUILD_TIMEOUT_S,
    ):
        return None
    for old in stale_builds(path.parent.glob("libllm_skinny-*.so"), keep=path):
        old.unlink(missing_ok=True)
    return path


def touch(path: Path) -> None:
    """Mark a build as used now (its age is what `stale_builds` reads)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def stale_builds(builds, keep: Path) -> list[Path]:
    """Those of `builds` (files, or folders of them) that can go: not `keep`, unused for
    STALE_AFTER_S and mapped by no running process. Deleting a build another process still
    runs, or will hand to its children in LD_PRELOAD (a server of the previous version during
    an upgrade, a second checkout's tests), makes each child start with an ld.so error and
    without the library."""
    now = time.time()
    candidates = []
    for build in builds:
        try:
            if build != keep and now - build.stat().st_mtime > STALE_AFTER_S:
                candidates.append(build)
        except OSError:
            continue
    if not candidates:
        return []
    mapped = mapped_by_any_process()
    return [b for b in candidates if not _mapped(b.resolve(), mapped)]


def _mapped(build: Path, mapped: set[str]) -> bool:
    return any(m == str(build) or m.startswith(f"{build}/") for m in mapped)


def mapped_files(maps: str) -> set[str]:
    """The shared objects named in a /proc/<pid>/maps text. A file deleted or replaced since it
    was mapped (another build of the skinny library, an upgrade) still counts: the process runs
    its copy, which the kernel marks ' (deleted)'."""
    files = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and ".so" in fields[5]:
            files.add(fields[5].removesuffix(" (deleted)"))
    return files


def mapped_by_any_process() -> set[str]:
    """Every file some process this user can see has mapped (its /proc/<pid>/maps)."""
    files: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            files |= mapped_files(maps.read_text())
        except OSError:  # gone, or another user's
            continue
    return files


@functools.cache
def loaded() -> bool:
    """Whether this process has the library mapped (preloaded)."""
    try:
        with open("/proc/self/maps") as maps:
            return "libllm_skinny-" in maps.read()
    except OSError:
        return False


@functools.cache
def handle() -> ctypes.CDLL | None:
    """The built library loaded by ctypes (for tests and benchmarks), or None."""
    path = build()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    f = ctypes.c_float
    p = ctypes.c_void_p
    i = ctypes.c_int
    lib.llm_skinny_sgemm.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    lib.llm_skinny_sgemm.restype = None
    lib.llm_skinny_threads.restype = i
    return lib
