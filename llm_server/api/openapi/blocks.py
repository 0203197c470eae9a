"""Building blocks shared by the modules of the OpenAPI document (document.py and its parts)."""

from __future__ import annotations

STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}


def number_range(lo: float, hi: float) -> dict:
    """A number schema bounded to [lo, hi] (whole bounds written as integers: 2, not 2.0)."""
    return {"type": "number", "minimum": _plain(lo), "maximum": _plain(hi)}


def _plain(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def json_response(schema_name: str, description: str) -> dict:
    """A response whose body is the named component schema."""
    return {
        "description": description,
        "content": {"application/json": {"schema": ref(schema_name)}},
    }


def post(op_id: str, summary: str, request: str, ok: dict, errors: dict) -> dict:
    """A POST path item taking the named JSON request schema."""
    return {
        "post": {
            "operationId": op_id,
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ref(request)}},
            },
            "responses": {"200": ok, **errors},
        }
    }


def list_of(item: dict, **extra: dict) -> dict:
    """An OpenAI list envelope {"object": "list", "data": [item, ...]} plus required `extra`."""
    return {
        "type": "object",
        "required": ["object", "data", *extra],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "data": {"type": "array", "items": item},
            **extra,
        },
    }


ERROR_STATUSES = {
    "400": "invalid field (the message names it and the allowed range)",
    "401": "missing or wrong API key (/v1/* when a key is set)",
    "404": "unknown model (or file, batch)",
    "409": "the batch has finished and cannot be cancelled",
    "413": "request body over the size limit",
    "415": "the body is not sent as application/json",
    "429": "every row busy and the queue full (see Retry-After)",
    "503": "the model is loading or the server is shutting down",
}


# One server-sent event: `data` is a JSON chunk (or an error object), then "[DONE]".
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": STR, "event": STR, "id": STR},
}


POST_ERRORS = ("400", "401", "404", "413", "415", "429", "503")


def errors(*statuses: str) -> dict:
    """The error responses (the Error schema) for these HTTP statuses."""
    return {s: json_response("Error", ERROR_STATUSES[s]) for s in statuses}


def post_path(
    op_id: str,
    summary: str,
    request: str,
    response: str,
    stream: bool = False,
    statuses: tuple[str, ...] = POST_ERRORS,
) -> dict:
    """A POST path item answering the named schema (and SSE when `stream`), with `statuses`."""
    ok = json_response(response, "success")
    if stream:
        ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    return post(op_id, summary, request, ok, errors(*statuses))


def get_path(op_id: str, summary: str, response: dict, *statuses: str) -> dict:
    """A GET path item answering `response`, with the errors for `statuses`."""
    return {
        "get": {
            "operationId": op_id,
            "summary": summary,
            "responses": {"200": response, **errors(*statuses)},
        }
    }
