"""POST /v1/completions: generation (one per prompt, JSON or SSE) and scoring (C5)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llm_server.api.openai.chat_completions import SSE_HEADERS
from llm_server.api.openai.logprobs import completion_logprobs, scored_choice
from llm_server.api.shared.errors import APIError, invalid
from llm_server.api.shared.handling import (
    admit_all,
    check_model,
    check_prompt,
    get_service,
    read_json,
    record_finish,
    scheduler_errors,
    served_id,
    settle,
    stream_failure,
    usage,
)
from llm_server.api.shared.schemas import CompletionRequest, parse_completion
from llm_server.api.shared.streaming import collect_many, finish_reason, merge_events, sse
from llm_server.decoding import FinishReason
from llm_server.scheduler import FinishEvent, QueueFull, SchedulerClosed, TokenEvent
from llm_server.scheduler.scorer import ScoringError
from llm_server.service import GenerationHandle, ModelService


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its ids and the text `echo` shows for it."""

    ids: list[int]
    text: str


def _prompts(service: ModelService, req: CompletionRequest) -> list[Prompt]:
    tok = service.tokenizer
    out = []
    for i, p in enumerate(req.prompts):
        if isinstance(p, str):
            prompt = Prompt(tok.encode(p), p)  # the tokenizer's default special tokens
        else:
            prompt = Prompt(list(p), tok.decode(p, skip_special_tokens=False))  # no BOS added
        check_prompt(
            service, len(prompt.ids), "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        )
        out.append(prompt)
    return out


def _is_scoring(req: CompletionRequest) -> bool:
    return req.echo and req.logprobs is not None


async def completions(request: Request) -> Response:
    service = get_service(request)
    req = parse_completion(
        await read_json(request),
        service.config.default_max_tokens,
        service.token_id_limit,
        service.sampling_defaults,
    )
    check_model(service, req.model, served_id(request))
    prompts = _prompts(service, req)
    rid = f"cmpl-{uuid.uuid4().hex}"
    base = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": served_id(request),
        "system_fingerprint": service.fingerprint,
    }
    if req.n > 1 and (_is_scoring(req) or req.params.max_tokens == 0):
        raise invalid("n", "'n' must be 1 when scoring or echoing ('max_tokens' 0)")
    if _is_scoring(req):
        return await _score(service, req, prompts, base)
    if req.params.max_tokens == 0:  # echo only: the prompt is the whole answer
        choices = [
            {"index": i, "text": p.text, "logprobs": None, "finish_reason": "length"}
            for i, p in enumerate(prompts)
        ]
        n_prompt = sum(len(p.ids) for p in prompts)
        return JSONResponse({**base, "choices": choices, "usage": usage(n_prompt, 0)})
    # before any SSE byte; choice i is choice i % n of prompt i // n
    handles = admit_all(service, [p.ids for p in prompts], req.params, req.n)
    if req.stream:
        return StreamingResponse(
            _stream(request, service, req, prompts, handles, base),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outs = await collect_many(handles, request)
    if (early := settle(request, [o.finish for o in outs])) is not None:
        return early
    choices = []
    for i, o in enumerate(outs):
        p = prompts[i // req.n]
        lp = None
        if req.logprobs is not None:
            lp = completion_logprobs(o.logprobs, service.tokenizer.token_strings)
        text = (p.text if req.echo else "") + o.text
        choices.append(
            {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(o.finish)}
        )
    firsts = [o.finish for o in outs[:: req.n]]  # each prompt counts once
    n_completion = sum(o.finish.completion_tokens for o in outs)
    body = {**base, "choices": choices, "usage": _usage(firsts, n_completion)}
    return JSONResponse(body)


def _usage(firsts: list[FinishEvent], n_completion: int) -> dict:
    """Prompt tokens (and of them those from the prefix cache) of each prompt once."""
    cached = [f.cached_tokens for f in firsts]
    n_cached = None if None in cached else sum(cached)
    return usage(sum(f.prompt_tokens for f in firsts), n_completion, n_cached)


async def _stream(
    request: Request,
    service: ModelService,
    req: CompletionRequest,
    prompts: list[Prompt],
    handles: list[GenerationHandle],
    base: dict,
) -> AsyncIterator[str]:
    offsets = [0] * len(handles)
    firsts: list[FinishEvent] = []
    n_completion = 0

    def chunk(index: int, text: str, finish: str | None = None, lp: dict | None = None) -> str:
        body = {
            **base,
            "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}],
        }
        if req.include_usage:
            body["usage"] = None
        return sse(body)

    if req.echo:
        for i in range(len(handles)):
            yield chunk(i, prompts[i // req.n].text)
    async for i, ev in merge_events(handles):
        if isinstance(ev, TokenEvent):
            lp = None
            if ev.logprob is not None:
                lp = completion_logprobs([ev.logprob], service.tokenizer.token_strings, offsets[i])
                offsets[i] += sum(len(s) for s in lp["tokens"])
            if ev.text or lp is not None:
                yield chunk(i, ev.text, lp=lp)
            continue
        if ev.reason == FinishReason.CANCELLED:
            return
        record_finish(request, ev)
        if ev.reason == FinishReason.ERROR:
            yield sse(stream_failure(ev))
            return
        if i % req.n == 0:  # each prompt counts once, whatever n is
            firsts.append(ev)
        n_completion += ev.completion_tokens
        yield chunk(i, "", finish=finish_reason(ev))
    if req.include_usage:
        yield sse({**base, "choices": [], "usage": _usage(firsts, n_completion)})
    yield sse("[DONE]")


async def _score(
    service: ModelService, req: CompletionRequest, prompts: list[Prompt], base: dict
) -> Response:
    """echo + logprobs: every prompt's token logprobs in one scoring call (C1, C5)."""
    if req.params.max_tokens > 1:
        raise invalid(
            "max_tokens",
            f"'max_tokens' must be 0 or 1 with 'echo' and 'logprobs' (scoring), got "
            f"{req.params.max_tokens}",
        )
    if req.stream:
        raise invalid("stream", "'stream' is not supported with 'echo' and 'logprobs' (scoring)")
    generate_one = req.params.max_tokens == 1
    try:
        scored = await service.score([p.ids for p in prompts], req.logprobs or 0, generate_one)
    except (QueueFull, SchedulerClosed) as exc:
        raise scheduler_errors(exc) from None
    except ScoringError:
        raise APIError(
            500, "the model failed while scoring this request", code="engine_error"
        ) from None
    except ValueError as exc:  # the scorer's own prompt checks
        raise invalid("prompt", str(exc)) from None
    tok = service.tokenizer
    choices = [
        scored_choice(i, sp, p.text, tok.token_strings, tok.decode)
        for i, (p, sp) in enumerate(zip(prompts, scored, strict=True))
    ]
    n_prompt = sum(len(p.ids) for p in prompts)
    n_generated = sum(sp.generated is not None for sp in scored)
    return JSONResponse({**base, "choices": choices, "usage": usage(n_prompt, n_generated)})
