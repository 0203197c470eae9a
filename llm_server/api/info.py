"""Read-only routes: models, health, and the tokenizer endpoints lm-evaluation-harness reads."""

from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llm_server.api.chat.plan import render_prompt
from llm_server.api.managed_models import list_managed, managed_health
from llm_server.api.shared.errors import invalid
from llm_server.api.shared.handling import check_model, get_service, read_json, served_id
from llm_server.api.shared.images import input_modalities, load_images
from llm_server.api.shared.schemas import parse_messages
from llm_server.api.shared.state import AppState
from llm_server.api.shared.tool_fields import parse_template_kwargs, parse_tools
from llm_server.models.memory import rss_bytes
from llm_server.native.blas import active_blas, float32_precision


async def list_models(request: Request) -> Response:
    st: AppState = request.app.state.llm
    if st.manager is not None:
        return list_managed(st.manager)
    created = int(st.service.started_at) if st.service else int(time.time())
    model = {
        "id": st.model_id,
        "object": "model",
        "created": created,
        "owned_by": "llm-server",
        "input_modalities": input_modalities(st.service),  # null while loading
    }
    return JSONResponse({"object": "list", "data": [model]})


async def health(request: Request) -> Response:
    st: AppState = request.app.state.llm
    if st.manager is not None:
        return managed_health(st, st.manager)
    svc = st.service
    body: dict = {"status": "loading", "ready": False, "model": st.model_id, "blas": active_blas()}
    body["float32_precision"] = float32_precision()  # MLX_ENABLE_TF32: "full" or "tf32"
    if svc is not None and svc.ready:
        stats = svc.scheduler.stats()
        body.update(
            {
                "status": "draining" if st.draining else "ok",
                "ready": not st.draining,
                "engine": svc.engine.name,
                "dtype": svc.engine.dtype,
                # the engine's kernel set (engines/forward/kernels.py): linux_cpu or generic
                "kernels": svc.engine.kernels_name,
                # the KV store's format (--kv-dtype, --kv-bits) and one position's bytes
                "kv": {
                    "format": svc.engine.kv_format_name,
                    "bytes_per_token": svc.engine.kv_token_bytes(),
                },
                "batching": svc.batching,
                "concurrent_requests": stats.rows,
                "rows_busy": stats.rows_busy,
                "queue_length": stats.queued,
                "max_queued": svc.config.max_queued,
                "context_length": svc.context_length,
                "system_fingerprint": svc.fingerprint,
                "last_error": stats.last_error,
                "speculative": {
                    "mode": svc.scheduler.speculative if svc.engine.speculative else "off",
                    "spec_tokens": svc.scheduler.spec_tokens,
                    "drafted_tokens": stats.drafted_tokens,
                    "accepted_tokens": stats.accepted_tokens,
                    "cost_model": svc.scheduler.spec_costs.report(),
                },
            }
        )
        group = svc.engine.group_status()  # a model sharded over ranks
        if group is not None:
            body["distributed"] = group
        cache = svc.prefix_cache_stats()
        if cache is not None:
            body["prefix_cache"] = dataclasses.asdict(cache)  # memory and disk tiers
        body["memory"] = {  # what --max-memory counts (budget None: none given)
            "budget": svc.engine.budget_bytes(),
            "held": svc.engine.held_bytes().as_dict(),
            "rss": rss_bytes(),
        }
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


async def tokenize(request: Request) -> Response:
    """`{"prompt": str, "add_special_tokens": bool}` or `{"messages": [...]}` (with `tools`,
    `chat_template_kwargs` as in chat requests) -> token ids."""
    service = get_service(request)
    body = await read_json(request)
    check_model(service, body.get("model"), served_id(request))
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise invalid("add_special_tokens", "'add_special_tokens' must be a boolean")
    tok = service.tokenizer
    if "messages" in body:
        # the prompt chat sends (tools in the generic format where the template shows none)
        kwargs = parse_template_kwargs(body)
        messages = await load_images(
            parse_messages(body),
            request.app.state.image_limits,
            served_id(request),
            service.vision is not None,
            service.vision_error,
        )
        ids = render_prompt(service, list(messages), parse_tools(body), kwargs)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid(
                "prompt", "'prompt' is required and must be a string (or send 'messages')"
            )
        ids = tok.encode(prompt, add_special_tokens=add_special)
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": service.context_length,
            "tokens": ids,
            "token_strs": tok.token_strings(ids),
        }
    )


async def detokenize(request: Request) -> Response:
    """`{"tokens": [int]}` -> `{"prompt": str}` (special tokens kept, as vLLM does)."""
    service = get_service(request)
    body = await read_json(request)
    check_model(service, body.get("model"), served_id(request))
    tokens = body.get("tokens")
    vocab = service.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise invalid("tokens", "'tokens' is required and must be an array of token ids")
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise invalid("tokens", f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    return JSONResponse({"prompt": service.tokenizer.decode(tokens, skip_special_tokens=False)})


async def tokenizer_info(request: Request) -> Response:
    """Special tokens and chat template, as lm-eval's RemoteTokenizer reads them."""
    service = get_service(request)
    hf = service.tokenizer.hf
    template = getattr(hf, "chat_template", None)
    return JSONResponse(
        {
            "name_or_path": served_id(request),
            "tokenizer_class": type(hf).__name__,
            "eos_token": hf.eos_token,
            "eos_token_id": hf.eos_token_id,
            "bos_token": hf.bos_token,
            "bos_token_id": hf.bos_token_id,
            "pad_token": hf.pad_token,
            "pad_token_id": hf.pad_token_id,
            "unk_token": hf.unk_token,
            "chat_template": template if isinstance(template, str) else None,
            "model_max_length": service.context_length,
            "vocab_size": service.tokenizer.vocab_size,
        }
    )
