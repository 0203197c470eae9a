"""/openapi.json: a well-formed OpenAPI 3 document whose schemas match real responses."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from llm_server.api.app import ROUTES


def _to_json_schema(node, components):
    """OpenAPI 3.0 schema -> JSON Schema: inline $refs, turn `nullable` into a null branch."""
    if isinstance(node, list):
        return [_to_json_schema(n, components) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _to_json_schema(components[node["$ref"].rsplit("/", 1)[1]], components)
    out = {k: _to_json_schema(v, components) for k, v in node.items() if k != "nullable"}
    if node.get("nullable"):
        out = {"anyOf": [out, {"type": "null"}]}
    return out


@pytest.fixture(scope="module")
def spec(server):
    import httpx

    resp = httpx.get(server.url + "/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def test_document_is_well_formed(spec):
    assert spec["openapi"].startswith("3.")
    assert spec["info"]["title"] and spec["info"]["version"]
    components = spec["components"]["schemas"]
    for schema in components.values():
        jsonschema.Draft7Validator.check_schema(_to_json_schema(schema, components))
    served = {(r.path, m) for r in ROUTES if r.include_in_schema for m in r.methods - {"HEAD"}}
    described = {(p, m.upper()) for p, ops in spec["paths"].items() for m in ops}
    assert served == described
    op_ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(op_ids) == len(set(op_ids))
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (path, method)
            if method == "post" and "requestBody" in op:  # a cancel takes no body
                content = op["requestBody"]["content"]
                body = content.get("application/json") or content["multipart/form-data"]
                assert body["schema"]["$ref"]
            text = repr(op)
            for ref in [t.split("'")[0] for t in text.split("#/components/schemas/")[1:]]:
                assert ref in components, ref


CALLS = [
    (
        "post",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
        "200",
    ),
    ("post", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2, "logprobs": 1}, "200"),
    (
        "post",
        "/v1/completions",
        {"prompt": [1, 2, 3], "max_tokens": 1, "echo": True, "logprobs": 1},
        "200",
    ),
    ("post", "/v1/embeddings", {"input": ["a b", "c"], "dimensions": 8}, "200"),
    ("post", "/v1/embeddings", {"input": [[1, 2]], "encoding_format": "base64"}, "200"),
    ("post", "/v1/embeddings", {"input": ""}, "400"),
    ("get", "/v1/models", None, "200"),
    ("get", "/health", None, "200"),
    ("post", "/tokenize", {"prompt": "hi"}, "200"),
    ("post", "/detokenize", {"tokens": [5, 6]}, "200"),
    ("get", "/tokenizer_info", None, "200"),
    ("post", "/v1/chat/completions", {"messages": []}, "400"),
    ("post", "/v1/completions", {"prompt": "x", "model": "other"}, "404"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"), CALLS, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CALLS]
)
def test_responses_match_declared_schemas(spec, http, method, path, body, status):
    op = spec["paths"][path][method]
    components = spec["components"]["schemas"]
    if body is not None:
        request_schema = _to_json_schema(
            op["requestBody"]["content"]["application/json"]["schema"], components
        )
        if status == "200":
            jsonschema.validate(body, request_schema)
    resp = http.request(method, path, json=body)
    assert str(resp.status_code) == status, resp.text
    schema = op["responses"][status]["content"]["application/json"]["schema"]
    jsonschema.validate(resp.json(), _to_json_schema(copy.deepcopy(schema), components))


PNG_URL = "data:image/png;base64,iVBORw0KGgo="
IMAGE_BODIES = [
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is it?"},
                        {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}},
                        {"type": "image_url", "image_url": PNG_URL},
                    ],
                }
            ]
        },
    ),
    (
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL}]},
                {"type": "function_call", "call_id": "c", "name": "view", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": PNG_URL, "detail": "auto"}],
                },
            ]
        },
    ),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },
                        {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}},
                    ],
                }
            ],
        },
    ),
]


@pytest.mark.parametrize(("path", "body"), IMAGE_BODIES, ids=[p for p, _ in IMAGE_BODIES])
def test_image_parts_are_described(spec, path, body):
    """The document describes each API's image parts: a body with them validates, and one with
    an image part of a wrong shape does not."""
    components = spec["components"]["schemas"]
    op = spec["paths"][path]["post"]
    schema = _to_json_schema(op["requestBody"]["content"]["application/json"]["schema"], components)
    jsonschema.validate(body, schema)
    text = repr(schema)
    assert "--allow-image-urls" in text and "a text-only model answers 400" in text
    if path == "/v1/chat/completions":
        bad = copy.deepcopy(body)
        bad["messages"][0]["content"][1]["image_url"]["detail"] = "ultra"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_models_declare_input_modalities(spec, http):
    components = spec["components"]["schemas"]
    item = components["ModelList"]["properties"]["data"]["items"]
    assert item["properties"]["input_modalities"]["items"]["enum"] == ["text", "image"]
    assert http.get("/v1/models").json()["data"][0]["input_modalities"] == ["text"]
