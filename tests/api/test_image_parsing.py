"""Parsing images (issue 49): each API's image parts become image parts of the chat messages
in the user's order, and decoded ImageInputs, with the field each came from; text-only content
stays one string."""

from __future__ import annotations

import asyncio
import base64

import pytest

from llm_server.api.anthropic.input import chat_messages
from llm_server.api.openai.responses.items import input_messages
from llm_server.api.shared.images import ImageRef, load_images
from llm_server.api.shared.schemas import parse_messages
from llm_server.images import ImageInput, images_of
from llm_server.settings import ImageLimits
from tests.api.image_files import chat_body, data_url, png


def _load(messages, limits: ImageLimits | None = None, takes: bool = True):
    return asyncio.run(load_images(tuple(messages), limits or ImageLimits(), "m", takes))


# --- parsing: an accepted image arrives as an ImageInput part, in the user's order ---


def test_chat_image_url_parts_become_image_parts_in_order():
    red, blue = png(color=(255, 0, 0)), png(color=(0, 0, 255))
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(red), "detail": "low"}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": data_url(blue)},  # the string form
                ],
            },
        ]
    }
    messages = parse_messages(body)
    assert messages[0]["content"] == "Be brief."  # text-only content stays one string
    parts = _load(messages)[1]["content"]
    assert [p["type"] for p in parts] == ["image", "text", "image"]
    first, second = parts[0]["image"], parts[2]["image"]
    assert isinstance(first, ImageInput) and isinstance(second, ImageInput)
    assert first.image.getpixel((0, 0)) == (255, 0, 0) and second.image.getpixel((0, 0)) == (
        0,
        0,
        255,
    )
    assert first.field == "messages[1].content[0].image_url"
    assert second.field == "messages[1].content[2].image_url"
    assert parts[1] == {"type": "text", "text": "and"}


def test_text_parts_alone_stay_one_string():
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    }
    assert parse_messages(body)[0]["content"] == "ab"


def test_responses_input_image_in_messages_and_function_call_output():
    shot = data_url(png(color=(0, 255, 0)))
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": shot}]},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": shot, "detail": "high"},
            {"type": "input_text", "text": "that is the file"},
        ]},
    ]  # fmt: skip
    messages, _ = input_messages(items, set())
    loaded = _load(messages)
    assert [p["type"] for p in loaded[0]["content"]] == ["text", "image"]
    tool = loaded[2]
    assert tool["role"] == "tool" and [p["type"] for p in tool["content"]] == ["image", "text"]
    assert [i.field for i in images_of(list(loaded))] == [
        "input[0].content[1].image_url",
        "input[2].output[0].image_url",
    ]


def test_anthropic_image_blocks_and_tool_result_images():
    data = base64.b64encode(png()).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    raw = [
        {"role": "user", "content": [{"type": "text", "text": "Read it"}, image]},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image, {"type": "text", "text": "ok"}]},
            {"type": "text", "text": "What is it?"},
        ]},
    ]  # fmt: skip
    loaded = _load(chat_messages(raw))
    assert [p["type"] for p in loaded[0]["content"]] == ["text", "image"]
    assert loaded[2]["role"] == "tool" and [p["type"] for p in loaded[2]["content"]] == [
        "image",
        "text",
    ]
    assert loaded[3] == {"role": "user", "content": "What is it?"}  # text only: a string
    assert [i.field for i in images_of(list(loaded))] == [
        "messages[0].content[1].source",
        "messages[2].content[0].content[0].source",
    ]


def test_an_image_ref_never_reaches_a_renderer():
    ref = ImageRef("messages[0].content[0].image_url", url=data_url(png()))
    loaded = _load([{"role": "user", "content": [{"type": "image", "image": ref}]}])
    assert isinstance(loaded[0]["content"][0]["image"], ImageInput)


def test_warm_prompts_take_no_images():
    from llm_server.warm_prompts import warm_tokens

    item = {"messages": chat_body(data_url(png()))["messages"]}
    with pytest.raises(ValueError, match="warm prompt 0: images are not prefilled"):
        warm_tokens(None, [item])
