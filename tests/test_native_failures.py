"""The native parts' failure paths (native/jit.py, skinny.py, decode_ops.py): a compiler that
fails, a cache folder that cannot be written, no /proc files, no nanobind, a load-time check
that disagrees. Each leaves its part off with a warning, and the engine still serves: the
same tokens as with the decode ops switched off."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from llm_server.native import decode_ops, jit, skinny

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU only")

_CACHED = (skinny.build, skinny.loaded, decode_ops.build, decode_ops.module, jit.active)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty build cache and cleared memos; the real ones again afterwards."""
    monkeypatch.setenv("LLM_SERVER_CACHE", str(tmp_path / "cache"))
    for f in (*_CACHED, decode_ops.layer_module):
        f.cache_clear()
    yield tmp_path / "cache" / "native"
    for f in (*_CACHED, decode_ops.layer_module):
        f.cache_clear()


def _compiler(tmp_path: Path, body: str) -> str:
    """A stand-in compiler: a shell script running `body` (with $out: the -o argument)."""
    path = tmp_path / "fake-cc"
    path.write_text(
        '#!/bin/sh\nout=""\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
        + body
        + "\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _no_file(monkeypatch, module, name: str) -> None:
    real = open

    def fake_open(path, *args, **kw):
        if str(path) == name:
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, *args, **kw)

    monkeypatch.setattr(module, "open", fake_open, raising=False)


# -- skinny ----------------------------------------------------------------------------------


def test_no_cpuinfo_keys_the_build_by_the_processor_name(monkeypatch):
    with_flags = skinny.library_path()
    _no_file(monkeypatch, skinny, "/proc/cpuinfo")
    assert skinny.cpu_flags() == platform.processor()
    assert skinny.library_path() != with_flags  # another key: never a build for other flags


def test_no_proc_maps_means_not_loaded(monkeypatch, fresh):
    _no_file(monkeypatch, skinny, "/proc/self/maps")
    assert skinny.loaded() is False


def test_a_failing_compiler_is_logged_and_leaves_nothing(monkeypatch, fresh, tmp_path, caplog):
    monkeypatch.setenv("CC", _compiler(tmp_path, 'echo "fatal: no room" >&2; exit 1'))
    with caplog.at_level(logging.WARNING, logger="llm_server.native.skinny"):
        assert skinny.build() is None
    assert "skinny products not built" in caplog.text and "fatal: no room" in caplog.text
    assert not list(fresh.glob("*"))  # no library and no partial file


def _age(path, seconds=skinny.STALE_AFTER_S + 60):
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_new_build_removes_the_older_sources_builds_unused_for_a_day(
    monkeypatch, fresh, tmp_path
):
    monkeypatch.setenv("CC", _compiler(tmp_path, 'echo built > "$out"'))
    fresh.mkdir(parents=True)
    old = fresh / "libllm_skinny-0123456789abcdef.so"
    old.write_text("an earlier source's build")
    recent = fresh / "libllm_skinny-fedcba9876543210.so"
    recent.write_text("another checkout's build, used an hour ago")
    _age(old)
    _age(recent, 3600)
    path = skinny.build()
    assert path == skinny.library_path() and path.read_text() == "built\n"
    assert sorted(fresh.glob("*")) == sorted([path, recent])  # the day-old one went


def test_a_build_in_use_is_touched_and_a_mapped_one_is_never_removed(fresh, tmp_path):
    # a previous version's server maps its build (and hands it to its children in
    # LD_PRELOAD): removing it would start each child with an ld.so error, without the library
    fresh.mkdir(parents=True)
    old = fresh / "libllm_skinny-0123456789abcdef.so"
    shutil.copy(_libm(), old)
    _age(old)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print(1, flush=True); sys.stdin.read()",
            str(old),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "1\n"
        assert skinny.stale_builds([old], keep=fresh / "new.so") == []
    finally:
        holder.communicate("", timeout=30)
    assert skinny.stale_builds([old], keep=fresh / "new.so") == [old]
    assert skinny.stale_builds([old], keep=old) == []
    skinny.touch(old)  # what build() does to the build it finds
    assert skinny.stale_builds([old], keep=fresh / "new.so") == []


def _libm() -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "libm.so" in line or "libm-" in line:
            return line.split()[-1]
    pytest.skip("no libm mapped")


# -- jit ---------------------------------------------------------------------------------------


def test_a_wrapper_folder_that_cannot_be_written_leaves_the_compiler_alone(monkeypatch, tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(jit, "_folder", lambda: blocker / "jit-bin")  # mkdir fails
    env = {"PATH": os.environ["PATH"]}
    assert jit.wrapper_dir(env) is None
    assert jit.path_env(env) == env  # PATH unchanged, nothing dropped


def test_a_wrapper_gone_after_the_lookup_is_not_active(monkeypatch, fresh, tmp_path):
    gone = tmp_path / "jit-bin"
    monkeypatch.setattr(jit, "_folder", lambda: gone)
    monkeypatch.setattr(jit.shutil, "which", lambda name: str(gone / name))
    assert jit.active() is False


def test_an_unwritable_kernel_folder_is_left_alone(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    jit.drop_stale_kernels({"TMPDIR": str(blocker)})  # <blocker>/mlx/... cannot be made
    assert blocker.read_text() == "kept"


# -- decode ops -------------------------------------------------------------------------------


def test_disabled_decode_ops_are_not_built(monkeypatch, fresh):
    monkeypatch.setenv(decode_ops.DISABLE_ENV, "0")
    assert decode_ops.build() is None and decode_ops.module() is None
    assert not fresh.exists()


def test_no_nanobind_leaves_the_decode_ops_off(monkeypatch, fresh, caplog):
    def version(name):
        if name == "nanobind":
            raise importlib.metadata.PackageNotFoundError(name)
        return importlib.metadata.version(name)

    monkeypatch.setattr(decode_ops, "version", version)
    with caplog.at_level(logging.INFO, logger="llm_server.native.decode_ops"):
        assert decode_ops.module() is None
    assert "nanobind is not installed" in caplog.text


def test_a_failing_cxx_leaves_the_decode_ops_off(monkeypatch, fresh, tmp_path, caplog):
    if importlib.util.find_spec("nanobind") is None:
        pytest.skip("no nanobind")
    monkeypatch.setenv("CXX", _compiler(tmp_path, 'echo "error: mlx.h" >&2; exit 1'))
    with caplog.at_level(logging.WARNING, logger="llm_server.native.decode_ops"):
        assert decode_ops.module() is None
    assert "decode ops not built" in caplog.text and "error: mlx.h" in caplog.text


def test_a_build_that_does_not_load_is_refused_and_old_builds_go(
    monkeypatch, fresh, tmp_path, caplog
):
    if importlib.util.find_spec("nanobind") is None:
        pytest.skip("no nanobind")
    monkeypatch.setenv("CXX", _compiler(tmp_path, 'echo "not an ELF file" > "$out"'))
    old = fresh / "decode_ops-0123456789abcdef"
    old.mkdir(parents=True)
    (old / "_llm_decode_ops.so").write_text("an earlier source's build")
    _age(old)
    with caplog.at_level(logging.WARNING, logger="llm_server.native.decode_ops"):
        assert decode_ops.module() is None
    assert "decode ops not used" in caplog.text
    assert not old.exists() and decode_ops.build().exists()


@pytest.fixture(scope="module")
def real_ops():
    ops = decode_ops.module()
    if ops is None:
        pytest.skip("the decode ops extension is not built here")
    return ops


class _Off:
    """The real ops with one replaced."""

    def __init__(self, ops, **replace):
        self._ops, self._replace = ops, replace

    def __getattr__(self, name):
        return self._replace.get(name) or getattr(self._ops, name)


def test_the_load_check_refuses_a_wrong_attention_or_rms_norm(real_ops):
    decode_ops._check(real_ops)  # the real ops pass
    wrong = _Off(real_ops, attend=lambda *a: real_ops.attend(*a) * 1.001)
    with pytest.raises(RuntimeError, match="wrong attention"):
        decode_ops._check(wrong)
    norm = _Off(real_ops, rms_norm=lambda x, w, eps: mx.fast.rms_norm(x, w, eps * 2))
    with pytest.raises(RuntimeError, match="rms_norm differs"):
        decode_ops._check(norm)


def test_whole_layers_that_differ_are_not_used(monkeypatch, real_ops, fresh, caplog):
    if not real_ops.layer_ready():
        pytest.skip("the skinny library is not preloaded")
    off = np.float32(1 + 2**-20)
    wrong = _Off(real_ops, layer_rest=lambda *a: real_ops.layer_rest(*a) * off)
    monkeypatch.setattr(decode_ops, "module", lambda: wrong)
    with caplog.at_level(logging.WARNING, logger="llm_server.native.decode_ops"):
        assert decode_ops.layer_module() is None
    assert "not used for whole layers" in caplog.text and "x differs" in caplog.text


def test_an_engine_whose_decode_ops_fail_their_check_serves_as_without_them(
    monkeypatch, fresh, tiny_llama_path, tmp_path, caplog
):
    from llm_server.tokenizer import Tokenizer
    from tests.scheduler.helpers import make_request, start_scheduler

    tok = Tokenizer(tiny_llama_path)
    prompt = tok.encode("The decode ops failed their check, yet")

    def generate() -> tuple[list[int], object]:
        sched = start_scheduler(tiny_llama_path, 1)
        try:
            req, out = make_request(tok, prompt, 12, ignore_eos=True)
            sched.submit(req)
            assert out.done.wait(60)
            return out.tokens, sched.engine.fused.k.ops
        finally:
            sched.close(10)

    monkeypatch.setenv(decode_ops.DISABLE_ENV, "0")
    want, ops = generate()
    assert ops is None
    monkeypatch.delenv(decode_ops.DISABLE_ENV)
    decode_ops.module.cache_clear()  # the disabled run's None
    bad = tmp_path / "bad.so"
    bad.write_text("a build from another MLX")
    monkeypatch.setattr(decode_ops, "build", lambda: bad)
    with caplog.at_level(logging.WARNING, logger="llm_server.native.decode_ops"):
        got, ops = generate()
    assert ops is None and "decode ops not used" in caplog.text
    assert got == want and len(got) == 12


def test_make_install_names_the_built_extension_or_says_not_in_use(real_ops, capsys):
    """`python -m llm_server.native.decode_ops` (make install) builds ahead and says where."""
    import runpy
    import warnings

    with warnings.catch_warnings():  # runpy: the module is imported already
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module("llm_server.native.decode_ops", run_name="__main__")
    assert capsys.readouterr().out == f"decode ops: {real_ops.__file__}\n"


def test_the_build_finds_mlxs_headers_beside_an_mlx_folder_in_the_working_directory(
    monkeypatch, tmp_path
):
    """MLX's CPU JIT leaves `mlx/<version>/cpu` in the working directory; run from there,
    `mlx.__path__` (a namespace package) lists that folder first. The headers come from the
    installed package all the same."""
    (tmp_path / "mlx" / "0.0" / "cpu").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    import mlx

    assert Path(list(mlx.__path__)[0]) == tmp_path / "mlx"  # the trap is set
    includes = [a[2:] for a in decode_ops._command(tmp_path / "out.so") if a.startswith("-I")]
    assert any((Path(i) / "mlx" / "allocator.h").is_file() for i in includes), includes
