"""BLAS preload selection on Linux (BLIS preferred, OpenBLAS fallback, off)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llm_server.native import blas, skinny

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only preload")


def test_choice_follows_env_and_installed_libraries():
    assert blas.chosen_blas({"LLM_SERVER_BLAS": "off"}) is None
    assert blas.chosen_blas({"LLM_SERVER_NO_BLAS_PRELOAD": "1"}) is None
    installed = [n for n in blas.PREFERENCE if blas.library_path(n)]
    assert blas.chosen_blas({}) == (installed[0] if installed else None)
    for name in installed:
        env = blas.preload_env({"LLM_SERVER_BLAS": name, "LD_PRELOAD": "/x/libfoo.so"})
        first = [str(skinny.build())] if skinny.build() else []
        assert env["LD_PRELOAD"].split(":") == [*first, blas.library_path(name), "/x/libfoo.so"]
        alone = {"LLM_SERVER_BLAS": name, "LLM_SERVER_SKINNY": "0"}
        assert blas.preload_env(alone)["LD_PRELOAD"] == blas.library_path(name)
        assert blas.preload_env(env)["LD_PRELOAD"] == env["LD_PRELOAD"]  # idempotent


def test_mapped_files_count_a_library_replaced_since_it_was_mapped():
    """A server keeps running the skinny library it mapped when another build (a newer source
    in another checkout, an upgrade) replaces the file: /health must still name it."""
    maps = (
        "7f1c2a000000-7f1c2a001000 r-xp 00000000 08:01 123 "
        "/root/.cache/llm-server/native/libllm_skinny-0123456789abcdef.so (deleted)\n"
        "7f1c2b000000-7f1c2b100000 r-xp 00000000 08:01 456 "
        "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4\n"
        "7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0 [stack]\n"
        "7f1c2c000000-7f1c2c001000 rw-p 00000000 00:00 0\n"
    )
    assert blas.mapped_files(maps) == {
        "/root/.cache/llm-server/native/libllm_skinny-0123456789abcdef.so",
        "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
    }


def test_entry_point_runs_with_a_fast_blas_and_correct_products():
    """The process `make test` runs in has a real BLAS mapped, and its products are right."""
    if blas.chosen_blas() is None:
        pytest.skip("no BLIS or OpenBLAS installed")
    assert blas.active_blas().split()[0] in ("blis", "openblas")
    assert blas.check_blas()
    if skinny.build() is not None:  # built (a C compiler and AVX2/AVX-512): in front
        assert skinny.loaded() and blas.active_blas().endswith("+ skinny products")


@pytest.mark.parametrize("name", ["blis", "openblas"])
def test_each_library_computes_correct_products(name):
    if blas.library_path(name) is None:
        pytest.skip(f"{name} is not installed")
    code = "from llm_server.native import blas; assert blas.check_blas(); print(blas.active_blas())"
    for front in ("1", "0"):  # with the skinny library in front, and the BLAS alone
        env = blas.preload_env({**_base_env(), "LLM_SERVER_BLAS": name, "LLM_SERVER_SKINNY": front})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(name)
        in_front = front == "1" and skinny.build() is not None
        assert out.stdout.strip().endswith("+ skinny products") == in_front, out.stdout


def test_malloc_tunables_are_added_and_the_callers_win():
    if blas.chosen_blas({}) is None:
        pytest.skip("no BLIS or OpenBLAS installed: nothing is preloaded")
    wanted = ":".join(blas.HUGEPAGE_TUNABLES)
    assert blas.preload_env({})["GLIBC_TUNABLES"] == wanted
    assert blas.preload_env({"GLIBC_TUNABLES": wanted})["GLIBC_TUNABLES"] == wanted  # idempotent
    mine = "glibc.malloc.mmap_threshold=65536:glibc.cpu.x86_rep_movsb_threshold=4096"
    assert blas.preload_env({"GLIBC_TUNABLES": mine})["GLIBC_TUNABLES"] == (
        mine + ":glibc.malloc.hugetlb=1:glibc.malloc.arena_max=1"
    )
    assert "GLIBC_TUNABLES" not in blas.preload_env({"LLM_SERVER_HUGEPAGES": "0"})


@pytest.mark.parametrize("thread", [False, True])
def test_weight_sized_allocations_sit_in_huge_pages(thread):
    """Under the preload's tunables, 40 matrices of 3.4 MB (SmolLM2's down projection; each
    below the mmap threshold, so from malloc's heap) are backed by 2 MiB pages, allocated on
    the main thread or on another (the server loads its model on a worker thread); without
    them, by none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in thp or blas.chosen_blas({}) is None:
        pytest.skip(f"transparent huge pages off ({thp.strip()}) or nothing preloaded")
    code = (
        "import threading, numpy as np\n"
        "ws = []\n"
        "def load(): ws.extend(np.ones((576, 1536), np.float32) for _ in range(40))\n"
        + ("t = threading.Thread(target=load)\nt.start()\nt.join()\n" if thread else "load()\n")
        + "info = open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1]\n"
        "print(int(info.split()[0]) // 1024)\n"
    )
    huge_mb = {}
    for on in ("1", "0"):
        env = blas.preload_env({**_base_env(), "LLM_SERVER_HUGEPAGES": on})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        huge_mb[on] = int(out.stdout)
    if "[always]" not in thp:  # madvise: only what malloc advised
        assert huge_mb["0"] < 16, huge_mb
    assert huge_mb["1"] >= 64, huge_mb  # of 135 MB (about all of it on a quiet machine)


def _base_env() -> dict[str, str]:
    import os

    return {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "BLIS_NUM_THREADS", "GLIBC_TUNABLES")
    }
