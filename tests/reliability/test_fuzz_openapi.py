"""Schema-driven fuzzing of /openapi.json with schemathesis against a live loopback server.

Bounded: at most EXAMPLES valid and EXAMPLES invalid requests per operation (no shrinking,
fixed seed) and OPERATION_CAP_S of wall time for each; the server's context is 64 tokens and
generated `max_tokens` values are clamped to MAX_TOKENS so one request stays short. Checks: never a 500, status codes and content
types the document declares, bodies that validate against the declared schemas; the server
is healthy afterwards.
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.conftest import assert_wait_healthy  # noqa: E402

EXAMPLES = 25
OPERATION_CAP_S = 4.0
MAX_TOKENS = 8
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def small_server(tiny_model_path, tmp_path_factory):
    """The tiny model with a 64-token context, 2 rows, and 8 tokens unless asked for more; the
    Batch API's files in a temp dir."""
    from llm_server.testing.live import LiveServer, tiny_service

    svc = tiny_service(tiny_model_path, concurrent=2, context_length=64, default_max_tokens=8)
    srv = LiveServer(svc, data_dir=tmp_path_factory.mktemp("fuzz-data")).start()
    yield srv
    srv.stop()
    svc.scheduler.abort()
    svc.close(30)


def _clamp(case) -> None:
    """Keep a generated request's output short (a valid value stays valid)."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                body[key] = MAX_TOKENS


def _fuzz(operation, mode: GenerationMode, base_url: str) -> int:
    """Run up to EXAMPLES generated requests for one operation within OPERATION_CAP_S."""
    deadline = time.monotonic() + OPERATION_CAP_S
    ran = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        nonlocal ran
        if time.monotonic() > deadline:
            return
        _clamp(case)
        case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=60)
        ran += 1

    with contextlib.suppress(Unsatisfiable):  # no invalid request exists for a GET without inputs
        run()
    return ran


def test_openapi_fuzz(small_server):
    server = small_server
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    ran = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            t0 = time.monotonic()
            n = _fuzz(operation, mode, server.url)
            print(f"{operation.label} {mode.value}: {n} requests, {time.monotonic() - t0:.1f}s")
            ran += n
    assert ran >= 150, f"only {ran} requests ran within the time caps"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert_wait_healthy(http)
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 200
