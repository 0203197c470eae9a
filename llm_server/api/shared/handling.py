"""What every handler shares: the service accessor, body reading, admission and settling."""

from __future__ import annotations

import json
import re
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import Response

from llm_server.api.shared import recent
from llm_server.api.shared.errors import APIError, error_body, invalid
from llm_server.api.shared.request_log import note_finish
from llm_server.api.shared.state import MODEL_ID_KEY, AppState, scoped_service
from llm_server.decoding import FinishReason, LogitsConstraint, SamplingParams
from llm_server.distributed import group_lost
from llm_server.engines.contract import EmbeddingInputUnsupported
from llm_server.engines.kv.budget import REFUSED, RETRY_AFTER_S
from llm_server.engines.plan import EmbeddingSpan
from llm_server.scheduler import FinishEvent, QueueFull, SchedulerClosed
from llm_server.service import GenerationHandle, ModelService


def get_service(request: Request) -> ModelService:
    """The ready service, or 503 while loading or draining."""
    st: AppState = request.app.state.llm
    if st.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    service = scoped_service(request.scope, st)
    if service is None or not service.ready:
        raise APIError(
            503,
            "the model is still loading; retry shortly",
            code="model_loading",
            headers={"Retry-After": "1"},
        )
    return service


# A \uD800-\uDFFF escape: half of a surrogate pair, or a lone one that no tokenizer can encode.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_json(request: Request) -> dict:
    """The request body as a JSON object; 415 unless sent as JSON, 413 over the app's limit,
    400 when malformed.

    Requiring `Content-Type: application/json` makes browsers preflight cross-site requests,
    so a web page cannot make a loopback server generate (CORS is off unless configured).
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json', "
            f"got {media_type or 'no content type'!r}",
            code="unsupported_media_type",
        )
    limit: int = request.app.state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    try:
        text = bytes(body).decode("utf-8")  # strict: no encoded surrogates either
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply") from None
    if _SURROGATE_ESCAPE.search(text) and not _encodable(data):
        raise APIError(
            400,
            "the request body has an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
            "send valid Unicode text",
        )
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def _encodable(data: object) -> bool:
    """True when every string in `data` is valid Unicode (surrogate escapes come in pairs)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is over the {limit} byte limit", code="request_too_large"
    )


def check_model(service: ModelService, model: str | None, served_id: str) -> None:
    """404 unless `model` names the served model (or is absent / "default")."""
    names = (served_id, service.config.model_id, "default", *service.config.aliases)
    if model is not None and model not in names:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {served_id!r}",
            param="model",
            code="model_not_found",
        )


def check_prompt(service: ModelService, n_tokens: int, param: str) -> None:
    """400 for an empty prompt or one that does not fit the context (S4)."""
    if n_tokens == 0:
        raise invalid(param, f"'{param}' is empty; send at least one token")
    ctx = service.context_length
    if n_tokens > ctx:
        raise APIError(
            400,
            f"'{param}' has {n_tokens} tokens but the context holds {ctx}; shorten it",
            param=param,
            code="context_length_exceeded",
        )


def scheduler_errors(exc: Exception) -> APIError | None:
    """The HTTP error for an admission failure (429 full, 503 closing), else None."""
    if isinstance(exc, QueueFull):
        retry = str(max(1, round(exc.retry_after)))
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": retry})
    if isinstance(exc, SchedulerClosed):
        return APIError(503, str(exc), code="shutting_down")
    return None


def admit(
    service: ModelService,
    prompt: list[int],
    params: SamplingParams,
    constraint: LogitsConstraint | None = None,
    keep_tokens: frozenset[int] = frozenset(),
) -> GenerationHandle:
    """Admit one generation now (before any response byte, S3) or raise 429/503."""
    return admit_all(service, [prompt], params, 1, [constraint], keep_tokens)[0]


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The sampling of choice `choice` of a request: a seeded request's choices draw from
    seeds seed, seed + 1, ... (as vLLM derives them), so they differ yet each repeats."""
    if choice == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + choice)


def admit_all(
    service: ModelService,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int = 1,
    constraints: list[LogitsConstraint | None] | None = None,
    keep_tokens: frozenset[int] = frozenset(),
    prediction: tuple[int, ...] | None = None,
    embeddings: tuple[EmbeddingSpan, ...] = (),
) -> list[GenerationHandle]:
    """Admit `n` choices of every prompt, all or none (429/503 before any response byte).

    Handles come prompt by prompt, choices within each: handle i is choice index i (the order
    OpenAI gives `choices[i].index`). `constraints` has one entry per handle when given.
    `keep_tokens`: special tokens kept in the text (tool-call markers the parsers read).
    `prediction`: token ids every choice's output is expected to repeat (predicted outputs).
    `embeddings`: every prompt's embedding spans (a chat request's images, one prompt).
    """
    total = len(prompts) * n
    if n > 1 and total > service.capacity:
        raise invalid(
            "n",
            f"'n' asks for {total} generations but this server holds at most "
            f"{service.capacity} at once (running and queued)",
        )
    check_memory(service, prompts, params)
    ids = [p for p in prompts for _ in range(n)]
    per_choice = [choice_params(params, j) for _ in prompts for j in range(n)]
    try:
        spans = [embeddings] * len(ids)
        return service.start_generations(
            ids, per_choice, constraints, keep_tokens, prediction, embeddings=spans
        )
    except (QueueFull, SchedulerClosed) as exc:
        raise scheduler_errors(exc) from None
    except EmbeddingInputUnsupported as exc:  # images for a forward that cannot take their rows
        raise invalid("messages", str(exc)) from None


def check_memory(service: ModelService, prompts: list[list[int]], params: SamplingParams) -> None:
    """400 for a prompt whose KV at its requested length could never fit the memory budget:
    refused before any token, never attempted."""
    longest = max((len(p) for p in prompts), default=0)
    positions = min(longest + params.max_tokens, service.context_length)
    refusal = service.memory_refusal(positions)
    if refusal is not None:
        raise APIError(400, refusal, param="max_tokens", code="memory_budget_exceeded")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI usage; `cached_tokens` (prompt tokens from the prefix cache) where known."""
    out: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def settle(request: Request, finishes: list[FinishEvent | None]) -> Response | None:
    """Record finished generations; 499 when one was cancelled, APIError 500 when one failed.

    Returns None when every generation completed and the caller can build its response.
    """
    if any(f is None or f.reason == FinishReason.CANCELLED for f in finishes):
        return Response(status_code=499)
    for fin in finishes:
        record_finish(request, fin)
    lost = [f.error for f in finishes if f.reason == FinishReason.ERROR and group_lost(f.error)]
    if lost:  # a rank of a sharded model died: the server is going away (503, then exit)
        raise APIError(503, str(lost[0]), code="group_lost")
    refused = [f.error for f in finishes if f.reason == FinishReason.ERROR and budget_refused(f)]
    if refused:  # the KV could not grow within the memory budget now: retry later
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        message = str(refused[0])
        message = message[message.index(REFUSED) :]  # without the engine's "forward failed"
        raise APIError(503, message, code="insufficient_memory", headers=retry)
    if any(f.reason == FinishReason.ERROR for f in finishes):
        raise APIError(500, "the model failed while generating this request", code="engine_error")
    return None


def stream_failure(fin: FinishEvent) -> dict:
    """The error body a stream ends with when its generation failed: the memory budget's
    refusal (503 `insufficient_memory`, its numbers) or the engine's failure (500)."""
    if budget_refused(fin):
        message = fin.error[fin.error.index(REFUSED) :]
        return error_body(503, message, code="insufficient_memory")
    return error_body(500, "the model failed while generating this request")


def failure_message(fin: FinishEvent, what: str) -> tuple[int, str]:
    """(status, message) of a failed generation, for the streams of every API: the memory
    budget's refusal (503, its numbers) or the engine's failure (500, `what` failed)."""
    if budget_refused(fin):
        return 503, fin.error[fin.error.index(REFUSED) :]
    return 500, f"the model failed while generating this {what}"


def budget_refused(fin: FinishEvent) -> bool:
    """Whether a failed generation's error is the memory budget's refusal to grow its KV."""
    return bool(fin.error) and REFUSED in fin.error


def record_finish(request: Request, fin: FinishEvent) -> None:
    """Feed a finished generation into the app's metrics, the request log and the page's list
    of recent requests."""
    note_finish(fin)
    recent.note_finish(fin)
    request.app.state.metrics.tokens_generated.inc(fin.completion_tokens)


def served_id(request: Request) -> str:
    """The id of the model serving this request (as /v1/models lists it)."""
    return request.scope.get(MODEL_ID_KEY) or request.app.state.llm.model_id
