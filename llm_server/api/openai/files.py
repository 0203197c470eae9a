"""/v1/files: upload, list, read and delete the Batch API's files (OpenAI's shapes)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llm_server.api.openai.batch_state import batch_api, page
from llm_server.api.shared.errors import APIError, invalid

PURPOSES = ("batch",)  # what an upload may be for (batch_output/batch_error: the server's own)
MAX_FILES_LIMIT = 10_000


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the file is larger than this server's --max-file-size ({limit} bytes); split it into "
        "several batches",
        param="file",
        code="file_too_large",
    )


async def upload_file(request: Request) -> Response:
    """POST /v1/files (multipart: `file`, `purpose`)."""
    api = batch_api(request)
    declared = request.headers.get("content-length")
    slack = 64 * 1024  # the multipart envelope around the file
    if declared and declared.isdigit() and int(declared) > api.max_file_bytes + slack:
        raise _too_large(api.max_file_bytes)
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "multipart/form-data":
        raise APIError(
            415,
            f"upload a file as multipart/form-data with fields 'file' and 'purpose'; got "
            f"{media_type or 'no content type'!r}",
            code="unsupported_media_type",
        )
    async with request.form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose not in PURPOSES:
            raise invalid("purpose", f"'purpose' must be one of {', '.join(PURPOSES)}")
        if upload is None or isinstance(upload, str):
            raise invalid("file", "'file' must be a file part")
        content = await upload.read(api.max_file_bytes + 1)
        if len(content) > api.max_file_bytes:
            raise _too_large(api.max_file_bytes)
        filename = upload.filename or "upload.jsonl"
    return JSONResponse(api.store.add_file(content, filename, purpose))


async def list_files(request: Request) -> Response:
    """GET /v1/files (`purpose`, `after`, `limit`, `order`)."""
    api = batch_api(request)
    query = request.query_params
    files = api.store.files()
    if query.get("purpose"):
        files = [f for f in files if f["purpose"] == query["purpose"]]
    if query.get("order", "desc") == "asc":
        files.reverse()
    return JSONResponse(
        page(files, query, default_limit=MAX_FILES_LIMIT, max_limit=MAX_FILES_LIMIT)
    )


def _file(request: Request) -> dict:
    file_id = request.path_params["file_id"]
    file = batch_api(request).store.file(file_id)
    if file is None:
        raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return file


async def get_file(request: Request) -> Response:
    """GET /v1/files/{file_id}."""
    return JSONResponse(_file(request))


async def file_content(request: Request) -> Response:
    """GET /v1/files/{file_id}/content: the bytes as uploaded (or written by a batch)."""
    file = _file(request)
    content = batch_api(request).store.file_content(file["id"])
    if content is None:
        raise APIError(404, f"file {file['id']!r} has no content", code="file_not_found")
    return Response(content, media_type="application/jsonl")


async def delete_file(request: Request) -> Response:
    """DELETE /v1/files/{file_id}."""
    file = _file(request)
    batch_api(request).store.delete_file(file["id"])
    return JSONResponse({"id": file["id"], "object": "file", "deleted": True})
