"""Shared fixtures: tiny checkpoints built once per session, the real default model, servers."""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# Tests of the Linux CPU path's own mechanisms: the native decode ops and skinny products (built
# on Linux only), BLIS's bit patterns, and defaults that hold on the CPU only (compiled decode,
# fused layers with a rope table, quantized checkpoints dequantized at load). They carry the
# `linux_cpu` marker and skip elsewhere (a Mac: Metal or Accelerate). The exactness promises
# themselves (batched == alone, speculation on == off) are NOT here: on a Mac they are what a
# run should show. `LLM_SERVER_PRETEND_PLATFORM=darwin pytest --collect-only -q -m linux_cpu`
# (make test-mac-dry-run) lists what a Mac skips. Entries: path, or path::test-name pattern.
LINUX_CPU = (
    "tests/test_blas.py",
    "tests/test_skinny.py",
    "tests/test_native_jit.py",
    "tests/test_decode_ops.py",
    "tests/test_native_failures.py",
    "tests/engines/test_compiled_step.py",
    "tests/engines/test_fused_decode.py",
    "tests/engines/test_decode_attention.py",
    "tests/engines/test_mixed_forward.py::test_a_chunk_in_the_forward_of_seven_decoding_rows*",
    "tests/benchmark/test_step.py",
    "tests/api/test_quantized_serving.py::test_dequantized_*",
    "tests/api/test_quantized_serving.py::test_kept_quantized_with_a_warning_*",
    "tests/test_float32_check.py::test_a_failing_check_on_linux_*",
    "tests/test_float32_check.py::test_no_check_re_execs_*",
)
PRETEND_ENV = "LLM_SERVER_PRETEND_PLATFORM"  # e.g. darwin: skip as that platform would


def _linux_cpu() -> str | None:
    """None on Linux with MLX on the CPU, else why the linux_cpu tests skip here."""
    platform = os.environ.get(PRETEND_ENV) or sys.platform
    if not platform.startswith("linux"):
        return f"asserts the Linux CPU path (BLIS/skinny arithmetic, CPU defaults); {platform}"
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return "asserts the Linux CPU path; MLX runs on the GPU here"
    if os.environ.get("LLM_SERVER_KERNELS", "").strip().lower() == "generic":
        return "asserts the linux_cpu kernel set; LLM_SERVER_KERNELS=generic runs the generic one"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parents[1]
    why = None
    for item in items:
        if not item.path.is_relative_to(root):
            continue
        path = item.path.relative_to(root).as_posix()
        name = f"{path}::{item.name}"
        if any(fnmatch.fnmatchcase(name, e) or path == e for e in LINUX_CPU):
            item.add_marker(pytest.mark.linux_cpu)
            why = why or _linux_cpu() or "-"
            if why != "-":
                item.add_marker(pytest.mark.skip(reason=why))


from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 checkpoint (random float32 weights, real BPE tokenizer, ChatML)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: Path):
    """The tiny checkpoint's tokenizer through the server's own wrapper."""
    from llm_server.tokenizer import Tokenizer

    return Tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny-llama", TinySpec(arch="llama")
    )


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once into the user cache."""
    from llm_server.default_model import default_model_path as resolve

    return resolve()


@pytest.fixture
def make_service():
    """Factory for started services; every one is closed at teardown."""
    from llm_server.testing.live import tiny_service

    made = []

    def make(model_path: Path, concurrent: int = 1, max_queued: int = 16, **kw):
        svc = tiny_service(model_path, concurrent, max_queued, **kw)
        made.append(svc)
        return svc

    yield make
    for svc in made:
        svc.scheduler.abort()
        svc.close(30)


@pytest.fixture
def live_server():
    """Factory: a real uvicorn server on loopback for a model; stopped at teardown."""
    from llm_server.testing.live import serving

    with contextlib.ExitStack() as stack:

        def start(
            model_path: Path, concurrent: int = 1, max_queued: int = 16, app_options=None, **kw
        ):
            return stack.enter_context(
                serving(model_path, concurrent, max_queued, app_options, **kw)
            )

        yield start
