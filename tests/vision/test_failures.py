"""Bad images and a failing vision tower on a vision-language checkpoint: each fails its own
request (a 400 naming the field where the image is at fault, a 500 `vision_error` where the
tower is), nothing else is disturbed: the vision thread serves the next image and the rows
decoding beside it finish with the tokens they give alone."""

from __future__ import annotations

import asyncio
import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from llm_server.api.chat.run import start_chat
from llm_server.api.shared.errors import APIError
from llm_server.api.shared.images import decode_image
from llm_server.settings import ImageLimits
from tests.vision.helpers import answer, ask, chat, collect, picture

FAMILY = "gemma3"  # the fastest tiny VLM
TEXTS = ("Hello, how are you today?", "The capital of France is")


def _fail_for(digest: str, real):
    """`real`, except that it raises for the image whose digest is `digest`."""

    def call(*args):
        images = [a for a in args if hasattr(a, "digest")]
        images += [i for a in args if isinstance(a, list) for i in a if hasattr(i, "digest")]
        if any(i.digest == digest for i in images):
            raise RuntimeError("simulated decode error")
        return real(*args)

    return call


def test_a_failing_processor_or_tower_fails_that_request_alone(vlm_paths, make_service):
    """Text rows decode while one image request's processor fails (400 on the image's field)
    and another's tower fails (500 vision_error): the text rows' tokens and the next image
    request's are those they give alone."""
    path = vlm_paths[FAMILY]
    good, unreadable, broken = picture(1), picture(2), picture(3)
    svc = make_service(path, 4, step_tokens=8)
    vision = svc.vision
    vision._inputs = _fail_for(unreadable.digest, vision._inputs)
    vision._encode = _fail_for(broken.digest, vision._encode)
    texts = [chat([ask(None, t)], 16) for t in TEXTS]
    after = chat([ask(good)], 16)

    async def together():
        started = [await start_chat(svc, r) for r in texts]
        errors = []
        for image in (unreadable, broken):
            with pytest.raises(APIError) as info:
                await start_chat(svc, chat([ask(None, "First."), ask(image)]))
            errors.append(info.value)
        started.append(await start_chat(svc, after))
        return errors, await asyncio.gather(*(collect(s.handles[0]) for s in started))

    errors, results = asyncio.run(together())
    rejected, failed = errors
    assert rejected.status == 400 and rejected.param == unreadable.field
    assert (
        "image processor cannot read" in rejected.message and unreadable.field in rejected.message
    )
    assert failed.status == 500 and failed.code == "vision_error" and failed.param == broken.field
    assert "vision tower failed" in failed.message and "simulated decode error" in failed.message
    alone = make_service(path, 1, prefix_cache_bytes=0)
    for (got, _), request in zip(results, [*texts, after], strict=True):
        assert got == answer(alone, request)[0] and len(got) == 16
    assert svc.vision._thread._thread.is_alive()


def _png(seed: int, size: tuple[int, int] = (50, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def _chat_body(*urls: str, text: str = "What is this?", max_tokens: int = 12, **kw) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        **kw,
    }


def test_an_image_past_the_context_is_a_400_with_the_numbers(vlm_paths, live_server):
    """The text alone fits the context; with the image's positions it does not: a 400 on
    `messages` with both numbers, and the server answers the next request."""
    srv = live_server(vlm_paths[FAMILY], 2, context_length=48)
    url = f"{srv.url}/v1/chat/completions"
    admitted: list[int] = []  # the prompt lengths given rows
    start = srv.service.start_generations

    def counted(prompts, *args, **kw):
        admitted.extend(len(p) for p in prompts)
        return start(prompts, *args, **kw)

    srv.service.start_generations = counted
    words = ["word"] * 12
    for n in range(1, len(words) + 1):  # the longest text that fits without the image
        text = " ".join(words[:n])
        r = httpx.post(url, json=_chat_body(_url(_png(1)), text=text, max_tokens=1), timeout=60)
        if r.status_code == 400:
            break
        assert r.status_code == 200, r.text
    else:
        pytest.fail("the image always fit the context")
    error = r.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert "the context holds 48" in error["message"]
    assert admitted and all(n <= 48 for n in admitted)  # refused before any row was taken
    plain = httpx.post(
        url,
        json={"max_tokens": 1, "messages": [{"role": "user", "content": text}]},
        timeout=60,
    )
    assert plain.status_code == 200, plain.text  # the text alone fits
    huge = httpx.post(url, json=_chat_body(_url(_png(2, (900, 900))), max_tokens=1), timeout=60)
    assert huge.status_code in (200, 400), huge.text  # resized to the model's size, or too long
    again = httpx.post(url, json=_chat_body(_url(_png(1)), text="Hi", max_tokens=2), timeout=60)
    assert again.status_code == 200, again.text


def _tokens(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_the_bad_image_catalogue_while_other_rows_decode(vlm_paths, live_server):
    """Good image and text requests decode on four rows while a burst of bad ones arrives on
    the three APIs: every bad one is a 400 in its API's format naming the field (a tower that
    fails on one image: a 500 for that request), and the good ones give the tokens they
    give alone."""
    srv = live_server(vlm_paths[FAMILY], 4, app_options={"images": ImageLimits(max_images=1)})
    base = srv.url
    tower_fails = _png(9)
    vision = srv.service.vision
    digest = decode_image(tower_fails, "f", ImageLimits()).digest
    vision._encode = _fail_for(digest, vision._encode)
    goods = [
        _chat_body(_url(_png(1)), max_tokens=48),
        _chat_body(_url(_png(2)), text="Describe it.", max_tokens=48),
        {
            "max_tokens": 48,
            "temperature": 0,
            "logprobs": True,
            "messages": [{"role": "user", "content": TEXTS[0]}],
        },
    ]
    alone = [_tokens(httpx.post(f"{base}/v1/chat/completions", json=g, timeout=60)) for g in goods]

    corrupt = _png(3)[:40] + b"\x00" * 60
    anthropic_image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": ""},
    }

    def anthropic(source: dict) -> dict:
        block = {**anthropic_image, "source": {**anthropic_image["source"], **source}}
        content = [block, {"type": "text", "text": "What is this?"}]
        return {
            "model": FAMILY,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": content}],
        }

    def responses(url: str) -> dict:
        content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "Hi"}]
        return {"max_output_tokens": 4, "input": [{"role": "user", "content": content}]}

    field = "messages[0].content[0].image_url"
    bad = [  # (path, body, status, the field named: OpenAI's param, or in Anthropic's message)
        ("/v1/chat/completions", _chat_body(_url(corrupt)), 400, field),
        ("/v1/chat/completions", _chat_body(_url(_png(4), "image/bmp")), 400, field),
        ("/v1/chat/completions", _chat_body(_url(_png(4)), _url(_png(5))), 400, "content[1]"),
        ("/v1/chat/completions", _chat_body("http://example.com/a.png"), 400, field),
        ("/v1/chat/completions", _chat_body(_url(b"")), 400, field),
        ("/v1/chat/completions", _chat_body(_url(tower_fails)), 500, field),
        ("/v1/messages", anthropic({"data": base64.b64encode(corrupt).decode()}), 400, None),
        ("/v1/messages", anthropic({"media_type": "image/bmp", "data": "AAAA"}), 400, None),
        ("/v1/messages", anthropic({"data": base64.b64encode(tower_fails).decode()}), 500, None),
        ("/v1/responses", responses(_url(corrupt)), 400, "input[0].content[0]"),
        ("/v1/responses", responses("https://example.com/a.png"), 400, "input[0].content[0]"),
    ]

    with ThreadPoolExecutor(len(goods) + len(bad)) as pool:
        running = [
            pool.submit(httpx.post, f"{base}/v1/chat/completions", json=g, timeout=60)
            for g in goods
        ]
        refused = [
            pool.submit(httpx.post, f"{base}{path}", json=body, timeout=60)
            for path, body, *_ in bad
        ]
        together = [_tokens(f.result()) for f in running]
        answers = [f.result() for f in refused]

    for r, (path, _, status, named) in zip(answers, bad, strict=True):
        assert r.status_code == status, (path, r.text)
        body = r.json()
        if path == "/v1/messages":
            kind = "invalid_request_error" if status == 400 else "api_error"
            assert body["type"] == "error" and body["error"]["type"] == kind, body
            assert "messages[0].content[0]" in body["error"]["message"], body
        else:
            kind = "invalid_request_error" if status == 400 else "server_error"
            assert body["error"]["type"] == kind and named in (body["error"]["param"] or ""), body
    assert together == alone
    again = httpx.post(f"{base}/v1/chat/completions", json=goods[0], timeout=60)
    assert _tokens(again) == alone[0]  # the vision thread serves on
