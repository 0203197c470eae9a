"""The OpenAPI schemas and paths of the Batch API: /v1/files and /v1/batches (api/openai/files.py,
api/openai/batches.py), merged into api/openapi/document.py's document."""

from __future__ import annotations

from llm_server.api.openai.batches import MAX_BATCHES_LIMIT
from llm_server.api.openai.files import MAX_FILES_LIMIT, PURPOSES
from llm_server.api.openapi.blocks import (
    INT,
    OBJ,
    STR,
    errors,
    json_response,
    list_of,
    nullable,
    ref,
)
from llm_server.batch.lines import ENDPOINTS
from llm_server.batch.runner import COMPLETION_WINDOW

_STATUSES = [
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
_TIME = nullable(INT)

SCHEMAS = {
    "File": {
        "type": "object",
        "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
        "properties": {
            "id": STR,
            "object": {"type": "string", "enum": ["file"]},
            "bytes": INT,
            "created_at": INT,
            "filename": STR,
            "purpose": {"type": "string", "enum": ["batch", "batch_output", "batch_error"]},
            "status": {"type": "string", "enum": ["processed"]},
            "expires_at": _TIME,
            "status_details": nullable(STR),
        },
    },
    "FileUpload": {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {
            "file": {"type": "string", "format": "binary"},
            "purpose": {"type": "string", "enum": list(PURPOSES)},
        },
    },
    "FileList": list_of(ref("File"), first_id=nullable(STR), last_id=nullable(STR)),
    "FileDeleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": STR, "object": STR, "deleted": {"type": "boolean"}},
    },
    "BatchRequest": {
        "type": "object",
        "required": ["input_file_id", "endpoint"],
        "properties": {
            "input_file_id": STR,
            "endpoint": {"type": "string", "enum": list(ENDPOINTS)},
            "completion_window": {"type": "string", "enum": [COMPLETION_WINDOW]},
            "metadata": nullable({"type": "object", "additionalProperties": STR}),
        },
    },
    "Batch": {
        "type": "object",
        "required": ["id", "object", "endpoint", "input_file_id", "status", "created_at"],
        "properties": {
            "id": STR,
            "object": {"type": "string", "enum": ["batch"]},
            "endpoint": STR,
            "errors": nullable(OBJ),
            "input_file_id": STR,
            "completion_window": STR,
            "status": {"type": "string", "enum": _STATUSES},
            "output_file_id": nullable(STR),
            "error_file_id": nullable(STR),
            "created_at": INT,
            **{
                f"{s}_at": _TIME
                for s in (
                    "in_progress",
                    "expires",
                    "finalizing",
                    "completed",
                    "failed",
                    "expired",
                    "cancelling",
                    "cancelled",
                )
            },
            "request_counts": {
                "type": "object",
                "required": ["total", "completed", "failed"],
                "properties": {"total": INT, "completed": INT, "failed": INT},
            },
            "metadata": nullable(OBJ),
            "progress": {
                "type": "object",
                "description": "while the batch runs: lines done, completion tokens/s, "
                "estimated seconds left",
                "properties": {
                    "lines_done": INT,
                    "lines_total": INT,
                    "tokens_per_second": {"type": "number"},
                    "eta_seconds": nullable({"type": "number"}),
                },
            },
        },
    },
    "BatchList": list_of(ref("Batch"), first_id=nullable(STR), last_id=nullable(STR)),
}
# has_more is part of every page
for _name in ("FileList", "BatchList"):
    SCHEMAS[_name]["properties"]["has_more"] = {"type": "boolean"}


def _param(name: str, where: str, schema: dict, required: bool = False) -> dict:
    return {"name": name, "in": where, "required": required, "schema": schema}


def _page_params(max_limit: int) -> list[dict]:
    return [
        _param("after", "query", STR),
        _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": max_limit}),
    ]


def _op(op_id: str, summary: str, ok: dict, statuses: tuple[str, ...], **extra) -> dict:
    return {
        "operationId": op_id,
        "summary": summary,
        "responses": {"200": ok, **errors(*statuses)},
        **extra,
    }


def paths() -> dict:
    file_id = [_param("file_id", "path", STR, required=True)]
    batch_id = [_param("batch_id", "path", STR, required=True)]
    return {
        "/v1/files": {
            "post": _op(
                "uploadFile",
                "Upload a batch input file (JSONL, up to --max-file-size)",
                json_response("File", "the stored file"),
                ("400", "401", "413", "415"),
                requestBody={
                    "required": True,
                    "content": {"multipart/form-data": {"schema": ref("FileUpload")}},
                },
            ),
            "get": _op(
                "listFiles",
                "The stored files, newest first",
                json_response("FileList", "a page of files"),
                ("400", "401"),
                parameters=[
                    _param("purpose", "query", STR),
                    _param("order", "query", {"type": "string", "enum": ["asc", "desc"]}),
                    *_page_params(MAX_FILES_LIMIT),
                ],
            ),
        },
        "/v1/files/{file_id}": {
            "get": _op(
                "retrieveFile",
                "A file",
                json_response("File", "the file"),
                ("401", "404"),
                parameters=file_id,
            ),
            "delete": _op(
                "deleteFile",
                "Delete a file",
                json_response("FileDeleted", "deleted"),
                ("401", "404"),
                parameters=file_id,
            ),
        },
        "/v1/files/{file_id}/content": {
            "get": _op(
                "downloadFile",
                "A file's content (a batch's output and error files: one JSON line per request)",
                {
                    "description": "the bytes",
                    "content": {"application/jsonl": {"schema": {"type": "string"}}},
                },
                ("401", "404"),
                parameters=file_id,
            )
        },
        "/v1/batches": {
            "post": _op(
                "createBatch",
                "Run a file's requests at the lowest priority",
                json_response("Batch", "the batch, validating"),
                ("400", "401", "404", "413", "415"),
                requestBody={
                    "required": True,
                    "content": {"application/json": {"schema": ref("BatchRequest")}},
                },
            ),
            "get": _op(
                "listBatches",
                "The batches, newest first",
                json_response("BatchList", "a page of batches"),
                ("400", "401"),
                parameters=_page_params(MAX_BATCHES_LIMIT),
            ),
        },
        "/v1/batches/{batch_id}": {
            "get": _op(
                "retrieveBatch",
                "A batch, with its progress while it runs",
                json_response("Batch", "the batch"),
                ("401", "404"),
                parameters=batch_id,
            )
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": _op(
                "cancelBatch",
                "Cancel a batch (lines done so far stay in its output)",
                json_response("Batch", "the batch, cancelling"),
                ("401", "404", "409"),
                parameters=batch_id,
            )
        },
    }
