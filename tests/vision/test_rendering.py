"""A chat request with images through each family's own chat template and processor: the parts
in the user's order, each image as the template expects it, the processor's positions, spans
keyed by the image; and the words when a model cannot take images."""

from __future__ import annotations

import json
import sys

import pytest

from llm_server.api.chat.plan import chat_inputs
from llm_server.api.shared.errors import APIError
from llm_server.images import ImageInput
from llm_server.testing.vision import VLM_FAMILIES
from llm_server.tokenizer import Tokenizer
from llm_server.vision import VisionUnavailable, load_vision
from llm_server.vision.messages import (
    image_runs,
    lift_tool_images,
    merge_user_turns,
    template_messages,
)
from tests.vision.helpers import answer, ask, chat, picture


def test_template_messages_show_images_as_image_parts():
    image = picture(1)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image", "image": image}],
        },
    ]
    shown = template_messages(messages)
    assert shown[0] == messages[0]
    assert shown[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}]
    assert messages[1]["content"][1]["image"] is image  # the request is not changed
    assert image_runs([3, 4, 5, 9, 10, 12]) == [(0, 3), (3, 5), (5, 6)]


def test_a_template_that_shows_only_parts_gets_strings_as_text_parts(vlm_paths):
    """SmolVLM's template renders a plain-string content as nothing: the tokenizer hands it
    every string as one text part, so text requests (and system turns) reach the model."""
    smolvlm = Tokenizer(vlm_paths["idefics3"])
    assert smolvlm.strings_as_parts
    text = smolvlm.render_chat([{"role": "system", "content": "Be brief."}, ask(None, "Hi")])
    assert "Be brief." in text and "Hi" in text
    plain = [{"role": "user", "content": "Hello there"}]
    assert "Hello there" in smolvlm.render_chat(plain)
    gemma = Tokenizer(vlm_paths["gemma3"])
    assert not gemma.strings_as_parts and "Hello there" in gemma.render_chat(plain)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_parts_render_in_order_through_the_checkpoints_own_template(family, vlm_paths):
    """Gemma 3's template knows only {"type": "image"}, SmolVLM's renders plain strings as
    nothing, LFM2-VL's writes unknown parts as JSON: none of that reaches the prompt."""
    path = vlm_paths[family]
    tok = Tokenizer(path)
    vision = load_vision(path, tok)
    try:
        a, b = picture(1), picture(2, (64, 64))
        messages = [
            {"role": "system", "content": "Answer in one word."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First"},
                    {"type": "image", "image": a},
                    {"type": "text", "text": "then"},
                    {"type": "image", "image": b},
                    {"type": "text", "text": "which is brighter?"},
                ],
            },
        ]
        ids, spans = vision.render(messages)
        text = tok.decode(ids, skip_special_tokens=False)
        order = [text.find(s) for s in ("Answer in one word.", "First", "then", "which is")]
        assert -1 not in order and order == sorted(order)
        assert '"type"' not in text and "digest" not in text  # no part written as JSON
        holder = vision.image_token_id
        positions = [i for i, t in enumerate(ids) if t == holder]
        assert sorted(p for s in spans for p in range(s.start, s.end)) == positions
        # each image's spans are keyed by its digest and hold what the tower gives it alone
        alone = [vision.render([ask(image)])[1] for image in (a, b)]
        assert [s.key for s in spans] == [s.key for image in alone for s in image]
        assert {s.key for s in alone[0]}.isdisjoint({s.key for s in alone[1]})
        for got, want in zip(spans, [s for image in alone for s in image], strict=True):
            assert got.length == want.length and (got.embeddings == want.embeddings).all()
    finally:
        vision.close()


def test_a_string_never_reaches_mlx_vlm_as_an_image(vlm_paths):
    path = vlm_paths["gemma3"]
    vision = load_vision(path, Tokenizer(path))
    try:
        url = ImageInput("https://example.com/x.png", "d" * 64, "messages[0].content[0]")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="decoded pixels"):
            vision.render([ask(url)])
    finally:
        vision.close()


def test_a_text_model_has_no_vision_and_other_vlms_images_are_refused_in_words(
    tiny_model_path, tmp_path
):
    assert load_vision(tiny_model_path, Tokenizer(tiny_model_path)) is None
    # a folder without config.json (a Core ML model's tokenizer folder) is text too
    assert load_vision(tmp_path, Tokenizer(tiny_model_path)) is None
    config = json.loads((tiny_model_path / "config.json").read_text())
    qwen = {"model_type": "qwen2_5_vl", "text_config": config, "vision_config": {"depth": 1}}
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(qwen))
    with pytest.raises(VisionUnavailable, match="M-RoPE"):
        load_vision(folder, Tokenizer(tiny_model_path))
    llava = {"model_type": "llava", "text_config": config, "vision_config": {}}
    (folder / "config.json").write_text(json.dumps(llava))
    with pytest.raises(VisionUnavailable, match=r"not served for llava \(served: gemma3, idefics3"):
        load_vision(folder, Tokenizer(tiny_model_path))


def test_a_vlm_without_mlx_vlm_serves_text_and_says_what_to_install(
    vlm_paths, make_service, monkeypatch
):
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # import mlx_vlm -> ImportError
    svc = make_service(vlm_paths["gemma3"], 1)
    assert svc.vision is None and "pip install 'llm-server[vision]'" in svc.vision_error
    with pytest.raises(APIError) as err:
        chat_inputs(svc, chat([ask(picture(1))]))
    assert err.value.status == 400 and err.value.param == "messages"
    assert "pip install 'llm-server[vision]'" in err.value.message
    ids, spans = chat_inputs(svc, chat([ask(None)]))  # text is served as before
    assert ids and spans == ()


def test_a_tool_results_images_open_the_next_user_turn():
    shot = {"type": "image", "image": picture(1)}
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    result = {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [{"type": "text", "text": "ok"}, shot],
    }
    lifted = lift_tool_images([ask(None, "Read it"), call, result])
    assert lifted[2] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert lifted[3] == {"role": "user", "content": [shot]}
    follow = lift_tool_images([call, result, {"role": "user", "content": "and?"}])
    assert follow[2]["content"] == [shot, {"type": "text", "text": "and?"}]
    merged = merge_user_turns([{"role": "user", "content": "<tool_response>ok"}, lifted[3]])
    assert merged == [
        {"role": "user", "content": [{"type": "text", "text": "<tool_response>ok"}, shot]}
    ]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_an_image_in_a_tool_result_reaches_the_model(family, vlm_paths, make_service):
    """A coding agent's tool result holding a screenshot (templates without tool syntax: the
    generic format, tool results as a user turn): the image's positions are in the prompt and
    no part of it is written as text."""
    svc = make_service(vlm_paths[family], 1)
    shot = picture(6)
    messages = [
        ask(None, "Open the screenshot"),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "shot.png"}, {"type": "image", "image": shot}],
        },
    ]
    ids, spans = chat_inputs(svc, chat(messages))
    text = svc.tokenizer.decode(ids, skip_special_tokens=False)
    assert spans and "shot.png" in text and "ImageInput" not in text and '"type"' not in text
    assert [s.key for s in spans] == [s.key for s in svc.vision.render([ask(shot)])[1]]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_images_in_several_turns_each_keep_their_own_spans(family, vlm_paths, make_service):
    svc = make_service(vlm_paths[family], 1)
    a, b = picture(2), picture(3)
    ids, spans = chat_inputs(svc, chat([ask(a), {"role": "assistant", "content": "x"}, ask(b)]))
    keys = [s.key for image in (a, b) for s in svc.vision.render([ask(image)])[1]]
    assert [s.key for s in spans] == keys


def test_a_template_that_rejects_an_image_where_it_stands_is_a_400(vlm_paths, make_service):
    svc = make_service(vlm_paths["gemma3"], 1)  # Gemma 3's template reads a system turn's text
    system = {"role": "system", "content": [{"type": "image", "image": picture(2)}]}
    with pytest.raises(APIError) as err:
        chat_inputs(svc, chat([system, ask(None)]))
    assert err.value.status == 400 and err.value.param == "messages"


def test_qwen_vl_serves_text_as_its_language_model_and_refuses_images_in_words(
    vlm_paths, make_service
):
    """Qwen2.5-VL places image positions with M-RoPE (3-D positions) the engine does not give:
    its images are refused with the reason, never answered with wrong logits; its text runs on
    mlx-lm's own classes and equals mlx-vlm's language model (text positions are the same
    in 1-D and in M-RoPE)."""
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    path = vlm_paths["qwen2_5_vl"]
    svc = make_service(path, 1)
    assert svc.vision is None and "M-RoPE" in svc.vision_error
    with pytest.raises(APIError) as err:
        chat_inputs(svc, chat([ask(picture(1))]))
    assert err.value.status == 400 and "M-RoPE" in err.value.message
    request = chat([{"role": "user", "content": "Hello, how are you?"}], 8)
    ours, _ = answer(svc, request)
    language_model = load_model(path).language_model
    ids = chat_inputs(svc, request)[0]
    for _ in range(8):  # mlx-vlm's greedy tokens, the whole sequence each step
        language_model._rope_deltas = language_model._position_ids = None  # (no state kept)
        logits = language_model(mx.array([ids])).logits[0, -1]
        ids.append(int(mx.argmax(logits)))
    assert ours == ids[-8:]


def test_a_tower_that_does_not_load_leaves_the_text_served(vlm_paths, tmp_path, make_service):
    import shutil

    folder = shutil.copytree(vlm_paths["gemma3"], tmp_path / "gemma3")
    (folder / "preprocessor_config.json").unlink()  # a processor file missing
    svc = make_service(folder, 1)
    assert svc.vision is None and "did not load" in svc.vision_error
    assert answer(svc, chat([ask(None)]))[0]  # the language model answers text
    with pytest.raises(APIError, match="did not load"):
        chat_inputs(svc, chat([ask(picture(1))]))


def test_a_gemma3_text_config_that_leaves_sizes_to_defaults_gets_mlx_vlms():
    """Real Gemma 3 configs omit the heads and the vocabulary (transformers' defaults): the
    language model is built with what mlx-vlm builds it with, and the context is 128k."""
    from llm_server.engines.mlx.vlm_checkpoint import text_config

    config = {
        "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    text = text_config(config)
    assert text["model_type"] == "gemma3_text" and text["hidden_size"] == 2560
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (
        8,
        4,
        256,
    )
    assert text["vocab_size"] == 262208 and text["max_position_embeddings"] == 131072
