"""Building blocks shared by the modules of the OpenAPI document (openapi.py and its parts)."""

from __future__ import annotations

STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}


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
