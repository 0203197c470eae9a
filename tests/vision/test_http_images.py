"""Images over the real HTTP server on a vision-language checkpoint, sent by the official SDKs
on the three APIs: each request is answered with its image in the prompt (the placeholder
positions counted in the usage), a resent image is cached, a changed one is not, and the
tower's time is on /metrics."""

from __future__ import annotations

import base64
import io
import re

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from llm_server.images import ImageInput

FAMILY = "gemma3"  # the fastest tiny VLM (4 positions per image)


def _png(seed: int) -> bytes:
    import numpy as np

    pixels = np.random.default_rng(seed).integers(0, 256, (40, 50, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


def _url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(seed)).decode()


def _image_positions(service, seed: int, text: str) -> tuple[int, int, int]:
    """(prompt length, first image position, image positions) the renderer gives one user
    turn of the image then `text`."""
    image = ImageInput(Image.open(io.BytesIO(_png(seed))).convert("RGB"), "x", "f")
    parts = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    ids, spans = service.vision.render([{"role": "user", "content": parts}])
    return len(ids), spans[0].start, sum(len(s.embeddings) for s in spans)


@pytest.fixture(scope="module")
def vlm(vlm_paths, tmp_path_factory):
    from llm_server.testing.live import serving

    with serving(vlm_paths[FAMILY], 4) as srv:
        yield srv


def _chat(client: openai.OpenAI, seed: int, text: str = "What is this?", **kw):
    return client.chat.completions.create(
        model=FAMILY,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _url(seed), "detail": "low"}},
                    {"type": "text", "text": text},
                ],
            }
        ],
        **kw,
    )


def test_openai_sdk_image_url_reaches_the_model_and_a_resent_image_is_cached(vlm):
    client = openai.OpenAI(base_url=f"{vlm.url}/v1", api_key="x", max_retries=0)
    length, first, positions = _image_positions(vlm.service, 11, "What is this?")
    assert positions >= 4
    one = _chat(client, 11)
    assert one.usage.prompt_tokens == length  # the image's placeholder positions counted
    again = _chat(client, 11)
    # the same image again: cached past every image position, the same answer
    assert again.usage.prompt_tokens_details.cached_tokens >= first + positions
    assert again.choices[0].logprobs.content == one.choices[0].logprobs.content
    other = _chat(client, 12)
    # a changed image: the cache stops at its first position, and the model sees the change
    assert other.usage.prompt_tokens_details.cached_tokens <= first
    assert [t.logprob for t in other.choices[0].logprobs.content] != [
        t.logprob for t in one.choices[0].logprobs.content
    ]


def test_anthropic_sdk_image_block_and_tool_result_image_reach_the_model(vlm):
    client = anthropic.Anthropic(base_url=vlm.url, api_key="x", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": _url(21).split(",", 1)[1]}
    image = {"type": "image", "source": source}
    plain = client.messages.create(
        model=FAMILY,
        max_tokens=4,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}],
    )
    length, _, _ = _image_positions(vlm.service, 21, "What is this?")
    usage = plain.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == length
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    turns = [
        {"role": "user", "content": "Read a.png"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]},
    ]  # fmt: skip
    read = client.messages.create(model=FAMILY, max_tokens=4, messages=turns)
    assert read.stop_reason in ("end_turn", "max_tokens")
    without = client.messages.count_tokens(
        model=FAMILY,
        messages=[
            *turns[:2],
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.png"}],
            },
        ],  # fmt: skip
    ).input_tokens
    counted = client.messages.count_tokens(model=FAMILY, messages=turns).input_tokens
    total = read.usage.input_tokens + read.usage.cache_read_input_tokens
    assert counted == total and counted >= without + 4  # the image's positions are in


def test_responses_input_image_inside_a_function_call_output(vlm):
    client = openai.OpenAI(base_url=f"{vlm.url}/v1", api_key="x", max_retries=0)

    def run(output):
        return client.responses.create(
            model=FAMILY,
            max_output_tokens=4,
            temperature=0,
            input=[
                {"role": "user", "content": "Look at the screenshot."},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "view_image",
                    "arguments": '{"path": "shot.png"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": output},
            ],  # fmt: skip
        )

    first = run([{"type": "input_image", "image_url": _url(31)}])
    second = run([{"type": "input_image", "image_url": _url(32)}])
    text_only = run("")
    assert first.status in ("completed", "incomplete")
    assert first.usage.input_tokens >= text_only.usage.input_tokens + 4  # the image's positions
    assert first.usage.input_tokens == second.usage.input_tokens  # same size, other pixels


def test_the_towers_time_is_on_metrics_and_a_resent_image_skips_it(vlm):
    client = openai.OpenAI(base_url=f"{vlm.url}/v1", api_key="x", max_retries=0)

    def counters() -> tuple[float, float]:
        text = httpx.get(f"{vlm.url}/metrics", timeout=10).text
        seconds = re.search(r"^llm_server_vision_encode_seconds_total (\S+)$", text, re.M)
        images = re.search(r"^llm_server_vision_images_total (\S+)$", text, re.M)
        assert seconds and images, text[-2000:]
        return float(seconds.group(1)), float(images.group(1))

    before = counters()
    _chat(client, 41)
    after_one = counters()
    _chat(client, 41, "And again?")
    after_two = counters()
    assert after_one[1] == before[1] + 1 and after_one[0] > before[0]
    assert after_two == after_one  # the resent image's rows were kept: no tower run


def test_a_vlm_whose_images_cannot_be_served_says_why(vlm_paths):
    """Qwen2.5-VL's text is served; an image is a 400 naming the field and the reason."""
    from llm_server.testing.live import serving

    with serving(vlm_paths["qwen2_5_vl"], 1) as srv:
        body = {
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _url(51)}},
                {"type": "text", "text": "What is this?"}]}],
        }  # fmt: skip
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages[0].content[0].image_url"
        assert "M-RoPE" in error["message"] and "reads text only" in error["message"]
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"]
        assert models[0]["input_modalities"] == ["text"]
