"""Images on the three chat APIs (issue 49): parsed into image parts in the user's order,
decoded by the server, and every bad image (and any image for a text-only model) a 400 in its
API's own error format naming the field, before any row is taken."""

from __future__ import annotations

import base64
import dataclasses
import threading

import anthropic
import httpx
import openai
import pytest

from llm_server.images import ImageInput, images_of
from tests.api.helpers import assert_openai_error
from tests.api.image_files import (
    assert_anthropic_error,
    bmp,
    bomb_png,
    chat_body,
    data_url,
    noise_png,
    png,
    zero_png,
)

CHAT, RESP, MESS = "/v1/chat/completions", "/v1/responses", "/v1/messages"


# --- bad images on every API, each in its own format ---

GOOD = png()
BAD = [
    # (case, file bytes or a URL, media type the request declares, words the message holds)
    ("corrupt", b"this is not an image", "image/png", "not a PNG, JPEG, WebP or GIF"),
    ("truncated", noise_png()[:600], "image/png", "truncated"),
    ("base64", "@@not base64@@", "image/png", "base64"),
    ("unsupported-format", bmp(), "image/png", "not a PNG, JPEG, WebP or GIF"),
    ("zero-size", zero_png(), "image/png", "no pixels"),
    ("too-many-pixels", bomb_png(8000, 8000), "image/png", "--max-image-pixels"),
    ("url-not-allowed", "https://example.com/cat.png", None, "--allow-image-urls"),
    ("file-url", "file:///etc/passwd", None, "file://"),
    ("media-type-mismatch", png(), "image/jpeg", "image/png"),
    ("text-only-model", GOOD, "image/png", "reads text only"),
]


def _url(value: bytes | str, media: str | None) -> str:
    if isinstance(value, str):
        return value if media is None else f"data:{media};base64,{value}"
    return data_url(value, media or "image/png")


def _responses(url: str) -> dict:
    parts = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": url},
    ]
    return {
        "model": "default",
        "max_output_tokens": 4,
        "input": [{"role": "user", "content": parts}],
    }


def _anthropic_source(value: bytes | str, media: str | None) -> dict:
    if isinstance(value, str) and media is None:
        return {"type": "url", "url": value}
    data = value if isinstance(value, str) else base64.b64encode(value).decode()
    return {"type": "base64", "media_type": media, "data": data}


def _messages(source: dict) -> dict:
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image", "source": source}]
    return {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}


def _anthropic_field(case: str, media: str | None) -> str:
    base = "messages[0].content[1].source"
    if media is None:
        return f"{base}.url"
    if case == "media-type-mismatch":
        return f"{base}.media_type"
    return base if case == "text-only-model" else f"{base}.data"


@pytest.fixture(scope="module")
def client(hermes_server):
    with httpx.Client(base_url=hermes_server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize(("case", "value", "media", "words"), BAD, ids=[c[0] for c in BAD])
def test_bad_images_are_400s_naming_the_field_on_each_api(client, case, value, media, words):
    url = _url(value, media)
    field = "messages[0].content[1].image_url"
    err = assert_openai_error(client.post(CHAT, json=chat_body(url)), 400, field)
    assert words in err["message"] and err["type"] == "invalid_request_error"
    field = "input[0].content[1].image_url"
    err = assert_openai_error(client.post(RESP, json=_responses(url)), 400, field)
    assert words in err["message"]
    body = _messages(_anthropic_source(value, media))
    assert_anthropic_error(client.post(MESS, json=body), 400, _anthropic_field(case, media), words)


def test_a_text_only_model_names_itself_and_the_field(client, hermes_server):
    model = hermes_server.state.model_id
    err = assert_openai_error(client.post(CHAT, json=chat_body(data_url(GOOD))), 400)
    assert repr(model) in err["message"] and "messages[0].content[1].image_url" in err["message"]


def test_more_images_than_max_images(client):
    url = data_url(GOOD)
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 9
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]}
    err = assert_openai_error(client.post(CHAT, json=body), 400, "messages[0].content[8].image_url")
    assert "9 images" in err["message"] and "--max-images" in err["message"]
    source = _anthropic_source(GOOD, "image/png")
    blocks = [{"type": "image", "source": source}] * 9
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}
    assert_anthropic_error(
        client.post(MESS, json=body), 400, "messages[0].content[8].source", "--max-images"
    )


def test_detail_file_id_and_role_are_checked(client):
    body = chat_body(data_url(GOOD))
    body["messages"][0]["content"][1]["image_url"]["detail"] = "ultra"
    assert_openai_error(
        client.post(CHAT, json=body), 400, "messages[0].content[1].image_url.detail"
    )
    body = {
        "model": "default",
        "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
    }
    err = assert_openai_error(client.post(RESP, json=body), 400, "input[0].content[0].file_id")
    assert "data: URL" in err["message"]
    body = {
        "model": "default",
        "messages": [
            {"role": "assistant", "content": [{"type": "image_url", "image_url": data_url(GOOD)}]},
            {"role": "user", "content": "x"},
        ],
    }
    assert_openai_error(client.post(CHAT, json=body), 400, "messages[0].content[0]")
    body = _messages({"type": "file", "file_id": "file_1"})
    assert_anthropic_error(
        client.post(MESS, json=body), 400, "messages[0].content[1].source", "base64"
    )


def test_responses_function_call_output_image_on_a_text_model(client):
    items = [
        {"role": "user", "content": "Show me the screenshot."},
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": data_url(GOOD)}]},
    ]  # fmt: skip
    body = {"model": "default", "max_output_tokens": 4, "input": items}
    # a tool's image on a text model: the agent's conversation goes on, the image omitted
    r = client.post(RESP, json=body)
    assert r.status_code == 200, r.text
    # a bad one is still a 400 naming it
    items[2]["output"][0]["image_url"] = (
        "data:image/png;base64," + base64.b64encode(b"\x89PNG junk").decode()
    )
    err = assert_openai_error(client.post(RESP, json=body), 400, "input[2].output[0].image_url")
    assert "PNG" in err["message"] or "image" in err["message"]


def test_tokenize_and_count_tokens_refuse_images_for_a_text_model(client):
    body = {"messages": chat_body(data_url(GOOD))["messages"]}
    assert_openai_error(
        client.post("/tokenize", json=body), 400, "messages[0].content[1].image_url"
    )
    body = _messages(_anthropic_source(GOOD, "image/png"))
    assert_anthropic_error(client.post(MESS + "/count_tokens", json=body), 400, "reads text only")


# --- the SDKs ---


def test_openai_sdk_image_url_refused_on_a_text_model(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            model="default",
            max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": data_url(GOOD), "detail": "auto"}},
            ]}],
        )  # fmt: skip
    assert err.value.status_code == 400
    assert err.value.body["param"] == "messages[0].content[1].image_url"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(
            model="default",
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(GOOD), "detail": "auto"}]}],
        )  # fmt: skip
    assert err.value.body["param"] == "input[0].content[0].image_url"


def test_anthropic_sdk_image_block_refused_and_tool_result_image_omitted_on_a_text_model(ant):
    image = {"type": "image", "source": _anthropic_source(GOOD, "image/png")}
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(
            model="default",
            max_tokens=4,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}],
        )
    assert err.value.status_code == 400 and "messages[0].content[0].source" in err.value.message
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}

    def turns(content) -> list[dict]:
        return [
            {"role": "user", "content": "Read shot.png"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": content}]},
        ]  # fmt: skip

    # Claude Code's Read of a PNG against a text model: answered, the image a line of text
    answer = ant.messages.create(model="default", max_tokens=4, messages=turns([image]))
    assert answer.stop_reason in ("end_turn", "max_tokens")
    note = "[image omitted: this model reads text only]\n"
    counted = [
        ant.messages.count_tokens(model="default", messages=turns(c)).input_tokens
        for c in ([image], note)
    ]
    assert counted[0] == counted[1]


def test_text_requests_are_untouched_while_bad_images_are_refused(oai, client):
    """A text request decoding beside a stream of refused image requests gets exactly the
    tokens it gets alone: the refusals take no row and touch no other request."""
    text = [{"role": "user", "content": "Count slowly from one to twenty."}]

    def ask():
        r = oai.chat.completions.create(
            model="default", messages=text, max_tokens=32, temperature=0
        )
        return r.choices[0].message.content, r.usage.completion_tokens

    alone = ask()
    result: list = []
    runner = threading.Thread(target=lambda: result.append(ask()))
    runner.start()
    refused = 0
    while runner.is_alive() or refused < 6:
        for case in (BAD[0], BAD[5], BAD[-1]):
            _, value, media, _ = case
            assert client.post(CHAT, json=chat_body(_url(value, media))).status_code == 400
            assert (
                client.post(MESS, json=_messages(_anthropic_source(value, media))).status_code
                == 400
            )
            refused += 2
    runner.join()
    assert result == [alone]


def test_models_report_input_modalities(client, hermes_server):
    (model,) = client.get("/v1/models").json()["data"]
    assert model["input_modalities"] == ["text"]
    hermes_server.service.vision = object()  # what a vision-language model's service holds
    try:
        (model,) = client.get("/v1/models").json()["data"]
        assert model["input_modalities"] == ["text", "image"]
    finally:
        hermes_server.service.vision = None


@pytest.fixture
def planned(hermes_server, monkeypatch):
    """The hermes server as if its model took images: each chat request that reaches planning
    is recorded, then planned with its images as text (this branch has no vision renderer)."""
    from llm_server.api.anthropic import messages as messages_route
    from llm_server.api.chat import run
    from llm_server.api.openai import chat_completions
    from llm_server.api.openai.responses import routes as responses_route

    seen: list = []
    real = run.start_chat

    async def recording(service, chat, *args, **kwargs):
        seen.append(chat)
        as_text = tuple(
            {
                **m,
                "content": "".join(
                    p["text"] if p["type"] == "text" else f"<image {p['image'].digest[:8]}>"
                    for p in m["content"]
                ),
            }
            if isinstance(m["content"], list)
            else m
            for m in chat.messages
        )
        return await real(service, dataclasses.replace(chat, messages=as_text), *args, **kwargs)

    for module in (chat_completions, responses_route, messages_route):
        monkeypatch.setattr(module, "start_chat", recording)
    monkeypatch.setattr(hermes_server.service, "vision", object())
    return seen


def test_sdk_images_reach_planning_as_image_inputs_in_order(planned, oai, ant):
    red, blue = png(color=(255, 0, 0)), png(color=(0, 0, 255))
    chat = oai.chat.completions.create(
        model="default",
        max_tokens=2,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(red)}},
            {"type": "text", "text": "versus"},
            {"type": "image_url", "image_url": {"url": data_url(blue), "detail": "high"}},
        ]}],
    )  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length")
    use = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "a.png"}}
    source = _anthropic_source(red, "image/png")
    message = ant.messages.create(
        model="default",
        max_tokens=2,
        messages=[
            {"role": "user", "content": "Read a.png"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": source}]}]},
        ],
    )  # fmt: skip
    assert message.stop_reason in ("end_turn", "max_tokens")
    response = oai.responses.create(
        model="default",
        max_output_tokens=16,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(blue)}]}],
    )
    assert response.status in ("completed", "incomplete")
    first, second, third = ([p["image"] for m in c.messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"] for c in planned)  # fmt: skip
    assert [i.field for i in first] == [
        "messages[0].content[0].image_url",
        "messages[0].content[2].image_url",
    ]
    assert first[0].image.getpixel((0, 0)) == (255, 0, 0) and first[1].image.getpixel((0, 0)) == (
        0,
        0,
        255,
    )
    assert [i.field for i in second] == ["messages[2].content[0].content[0].source"]
    assert second[0].digest == first[0].digest  # the same pixels from another API
    assert [i.field for i in third] == ["input[0].content[0].image_url"]
    assert third[0].digest == first[1].digest and all(
        isinstance(i, ImageInput) for i in first + second + third
    )


def test_a_stored_response_keeps_its_images_for_the_next_turn(planned, client):
    """`previous_response_id` carries turn 1's image into turn 2 (stored as sent, decoded
    again: the same digest)."""
    turn = {"role": "user", "content": [{"type": "input_image", "image_url": data_url(GOOD)}]}
    first = client.post(RESP, json={"model": "default", "max_output_tokens": 2, "input": [turn]})
    assert first.status_code == 200, first.text
    body = {"model": "default", "max_output_tokens": 2, "input": "And now?"}
    second = client.post(RESP, json={**body, "previous_response_id": first.json()["id"]})
    assert second.status_code == 200, second.text
    digests = [images_of(list(chat.messages))[0].digest for chat in planned]
    assert len(digests) == 2 and digests[0] == digests[1]
