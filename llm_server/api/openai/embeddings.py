"""POST /v1/embeddings: one pooled vector per input, batched on the scheduler's embedding pump."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llm_server.api.shared.errors import APIError, invalid
from llm_server.api.shared.handling import (
    check_model,
    check_prompt,
    get_service,
    read_json,
    scheduler_errors,
    served_id,
)
from llm_server.engines.contract import EmbeddingsUnsupported
from llm_server.pooling import truncate
from llm_server.scheduler import QueueFull, SchedulerClosed
from llm_server.scheduler.embedder import EmbeddingError, supports_embeddings
from llm_server.service import EmbeddingsUnavailable, ModelService

MAX_INPUTS = 2048  # inputs per request (OpenAI's bound)
ENCODINGS = ("float", "base64")
INPUT_TYPES = ("query", "document")


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: tuple[str | tuple[int, ...], ...]  # texts or token-id lists
    encoding_format: str  # "float" | "base64"
    dimensions: int | None  # truncate to this many features, then re-normalise
    input_type: str | None  # "query" | "document": the checkpoint's prompt prefix
    model: str | None
    single: bool  # `input` was one string or one id list (errors then name 'input')

    def field(self, index: int) -> str:
        return "input" if self.single else f"input[{index}]"


def _is_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _inputs(body: dict, vocab_size: int) -> tuple[tuple[str | tuple[int, ...], ...], bool]:
    value = body.get("input")
    if value is None:
        raise invalid("input", "'input' is required")
    single = isinstance(value, str) or _is_ids(value)
    if single:
        items: list = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise invalid(
            "input",
            "'input' must be a non-empty string, an array of strings, token ids, "
            "or arrays of token ids",
        )
    if len(items) > MAX_INPUTS:
        raise invalid("input", f"'input' has {len(items)} items; at most {MAX_INPUTS} per request")
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        name = "input" if single else f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise invalid(name, f"'{name}' is an empty string; send at least one character")
            out.append(item)
        elif _is_ids(item):
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise invalid(
                    name,
                    f"token id {bad[0]} in '{name}' is outside the vocabulary 0..{vocab_size - 1}",
                )
            out.append(tuple(item))
        else:
            raise invalid(
                name, f"'{name}' must be a non-empty string or a non-empty array of token ids"
            )
    return tuple(out), single


def parse_embedding(body: dict, vocab_size: int) -> EmbeddingRequest:
    """Validate a request body; raises APIError 400 naming the field at fault."""
    inputs, single = _inputs(body, vocab_size)
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ENCODINGS:
        raise invalid(
            "encoding_format", f"'encoding_format' must be 'float' or 'base64', got {fmt!r}"
        )
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise invalid("dimensions", f"'dimensions' must be a positive integer, got {dims!r}")
    input_type = body.get("input_type")
    if input_type is not None and input_type not in INPUT_TYPES:
        raise invalid(
            "input_type", f"'input_type' must be 'query' or 'document', got {input_type!r}"
        )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "'model' must be a string")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "'user' must be a string")
    return EmbeddingRequest(inputs, fmt, dims, input_type, model, single)


def _token_ids(service: ModelService, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's ids: texts get the checkpoint's prompt for `input_type` as a prefix."""
    prefix = ""
    if req.input_type is not None and service.embedding is not None:
        prefix = service.embedding.prompts.get(req.input_type, "")
    out = []
    for i, item in enumerate(req.inputs):
        name = req.field(i)
        if isinstance(item, str):
            ids = service.tokenizer.encode(prefix + item)
        elif prefix:
            raise invalid(
                "input_type",
                f"'input_type' {req.input_type!r} adds the text prefix {prefix!r}, which cannot "
                "be applied to token-id inputs; send text, or put the prefix in the ids",
            )
        else:
            ids = list(item)
        check_prompt(service, len(ids), name)  # 400 naming the context and the index
        out.append(ids)
    return out


def _encode(vector: np.ndarray, fmt: str) -> list[float] | str:
    """vector [hidden] float32 -> the JSON value of `embedding` in the requested format."""
    if fmt == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()  # Python floats, without a per-element call


async def embeddings(request: Request) -> Response:
    service = get_service(request)
    req = parse_embedding(await read_json(request), service.tokenizer.vocab_size)
    check_model(service, req.model, served_id(request))
    size = service.embedding.size if service.embedding is not None else None
    if req.dimensions is not None and size is not None and req.dimensions > size:
        raise invalid(
            "dimensions", f"'dimensions' is {req.dimensions} but the model's embeddings have {size}"
        )
    if not supports_embeddings(service.engine):
        refused = service.engine.no_embeddings or "the engine does not compute embeddings"
        raise APIError(400, refused, code="embeddings_unavailable")
    ids = _token_ids(service, req)
    try:
        vectors = await service.embed(ids)  # [n, hidden]
    except (EmbeddingsUnavailable, EmbeddingsUnsupported) as exc:
        raise APIError(
            400, f"this model does not serve embeddings: {exc}", code="embeddings_unavailable"
        ) from None
    except (QueueFull, SchedulerClosed) as exc:
        raise scheduler_errors(exc) from None
    except EmbeddingError as exc:
        raise APIError(
            500, f"the model failed while embedding: {exc}", code="engine_error"
        ) from None
    if req.dimensions is not None and req.dimensions > vectors.shape[1]:  # size was unknown
        raise invalid(
            "dimensions",
            f"'dimensions' is {req.dimensions} but the model's embeddings have {vectors.shape[1]}",
        )
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _encode(truncate(v, req.dimensions), req.encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    n_tokens = sum(len(x) for x in ids)
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": served_id(request),
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
    )
