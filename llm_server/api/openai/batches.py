"""/v1/batches: create, read, list and cancel batches (OpenAI's shapes; batch/runner.py runs
them)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llm_server.api.openai.batch_state import batch_api, page
from llm_server.api.shared.errors import APIError, invalid
from llm_server.api.shared.handling import read_json
from llm_server.batch.runner import COMPLETION_WINDOW, BatchNotFound

MAX_BATCHES_LIMIT = 100
DEFAULT_BATCHES_LIMIT = 20


async def create_batch(request: Request) -> Response:
    """POST /v1/batches (`input_file_id`, `endpoint`, `completion_window`, `metadata`)."""
    api = batch_api(request)
    body = await read_json(request)
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise invalid("input_file_id", "'input_file_id' must be a file id")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str):
        raise invalid("endpoint", "'endpoint' is required")
    window = body.get("completion_window", COMPLETION_WINDOW)
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise invalid("metadata", "'metadata' must be an object of strings")
    try:
        batch = api.runner.create(input_file_id, endpoint, str(window), metadata)
    except BatchNotFound as exc:
        raise APIError(404, str(exc), param="input_file_id", code="file_not_found") from None
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from None
    return JSONResponse(batch)


def _batch_id(request: Request) -> str:
    return request.path_params["batch_id"]


async def get_batch(request: Request) -> Response:
    """GET /v1/batches/{batch_id}: the batch, with `progress` while it runs."""
    try:
        return JSONResponse(batch_api(request).runner.get(_batch_id(request)))
    except BatchNotFound as exc:
        raise APIError(404, str(exc), code="batch_not_found") from None


async def list_batches(request: Request) -> Response:
    """GET /v1/batches (`after`, `limit`): newest first."""
    api = batch_api(request)
    batches = api.store.batches()
    return JSONResponse(
        page(batches, request.query_params, DEFAULT_BATCHES_LIMIT, MAX_BATCHES_LIMIT)
    )


async def cancel_batch(request: Request) -> Response:
    """POST /v1/batches/{batch_id}/cancel."""
    try:
        return JSONResponse(batch_api(request).runner.cancel(_batch_id(request)))
    except BatchNotFound as exc:
        raise APIError(404, str(exc), code="batch_not_found") from None
    except ValueError as exc:
        raise APIError(409, str(exc), code="batch_not_cancellable") from None
