"""Vision-language checkpoints served: each family's tower and projector (mlx-vlm) give an
image's rows, its language model runs in the engine with the rows as embedding spans, batched
with text requests and cached by the image's content.

Every test runs through the chat path (`api/chat/run.py: start_chat`, which plans with
`service.vision` and admits the spans) on tiny random checkpoints built with mlx-vlm's classes.
"""

from __future__ import annotations

import asyncio

import pytest

from llm_server.api.chat.run import start_chat
from llm_server.testing.vision import VLM_FAMILIES
from llm_server.tokenizer import Tokenizer
from tests.vision.helpers import answer, ask, chat, collect, picture

TEXTS = ("Hello, how are you today?", "The capital of France is", "One two three four five")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_an_image_request_batched_with_three_text_requests_equals_it_alone(
    family, vlm_paths, make_service
):
    """Five requests on four rows, small steps (prompt chunks ride beside decoding rows): two
    image requests with different images, three text requests; each equals itself alone."""
    path = vlm_paths[family]
    images = [chat([ask(picture(1))]), chat([ask(picture(2), "Describe it.")])]
    texts = [chat([ask(None, t)]) for t in TEXTS]
    order = [texts[0], images[0], texts[1], images[1], texts[2]]
    svc = make_service(path, 4, step_tokens=8)

    async def together():
        started = [await start_chat(svc, r) for r in order]
        return await asyncio.gather(*(collect(s.handles[0]) for s in started))

    batched = asyncio.run(together())
    alone = make_service(path, 1, prefix_cache_bytes=0)
    for (got, finish), request in zip(batched, order, strict=True):
        want, want_finish = answer(alone, request)
        assert got == want and len(want) == 10
        assert finish.prompt_tokens == want_finish.prompt_tokens
    assert batched[1][0] != batched[3][0]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_image_makes_the_answer_and_the_same_request_answers_the_same(
    family, vlm_paths, make_service
):
    svc = make_service(vlm_paths[family], 1, prefix_cache_bytes=0)
    a, b = picture(1), picture(2)
    first = answer(svc, chat([ask(a)]))[0]
    assert answer(svc, chat([ask(b)]))[0] != first  # two images, two answers
    assert answer(svc, chat([ask(a)]))[0] == first  # the same request, the same answer
    assert answer(svc, chat([ask(None)]))[0] != first  # without the image, another answer


@pytest.mark.parametrize("size", [(50, 40), (400, 400)])
@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_greedy_tokens_equal_mlx_vlms_own_generate(family, size, vlm_paths, make_service):
    """mlx-vlm's `stream_generate` at temperature 0 on the same folder, image and prompt text
    gives the same tokens, for a small image and one the processors tile (LFM2-VL: tiles and a
    thumbnail, its own tiling defaults). The logits' tolerance is the next test's."""
    import mlx_vlm

    path, image, n = vlm_paths[family], picture(3, size), 10
    ours, finish = answer(make_service(path, 1), chat([ask(image)], n))
    model, processor = mlx_vlm.load(str(path))
    text = Tokenizer(path).render_chat([_template_turn()])
    theirs = [
        r.token
        for r in mlx_vlm.stream_generate(
            model, processor, text, image=[image.image], max_tokens=n, temperature=0.0
        )
    ]
    assert ours == theirs[: len(ours)] and len(ours) == n
    svc_text = make_service(path, 1)  # and a text-only request: the language model alone
    plain = Tokenizer(path).render_chat([_template_turn(image=False)])
    ours_text, _ = answer(svc_text, chat([ask(None)], n))
    theirs_text = [
        r.token
        for r in mlx_vlm.stream_generate(model, processor, plain, max_tokens=n, temperature=0.0)
    ]
    assert ours_text == theirs_text[: len(ours_text)]
    assert finish.prompt_tokens > len(Tokenizer(path).encode(plain, add_special_tokens=False))


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_a_4bit_checkpoint_of_mlx_vlms_convert_serves_as_mlx_vlm_runs_it(
    family, vlm_paths, make_service, tmp_path
):
    """mlx-community's uploads are `mlx_vlm.convert -q` folders: the language model's layers
    4-bit (dequantized at load on this CPU), the tower's kept float; mlx-vlm's own generation on
    the same folder gives the same greedy tokens."""
    import mlx_vlm
    from mlx_vlm.convert import convert

    folder = tmp_path / f"{family}-4bit"
    convert(str(vlm_paths[family]), str(folder), quantize=True, q_group_size=64, q_bits=4)
    image, n = picture(3), 8
    ours, _ = answer(make_service(folder, 1), chat([ask(image)], n))
    model, processor = mlx_vlm.load(str(folder))
    text = Tokenizer(folder).render_chat([_template_turn()])
    stream = mlx_vlm.stream_generate(
        model, processor, text, image=[image.image], max_tokens=n, temperature=0.0
    )
    assert ours == [r.token for r in stream][: len(ours)] and len(ours) == n


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_first_logits_equal_mlx_vlms_forward_on_the_same_inputs(family, vlm_paths):
    """The logits after the prompt, the engine's (spans from the renderer) against mlx-vlm's
    model on the processor's inputs: bit-exact where the engine runs the language model through
    mlx-lm's modules (gemma3_text, lfm2) or under the generic kernel set. The Linux CPU set's
    fused llama layers (idefics3, smolvlm, mistral3) sum their products in another order (BLIS and the
    skinny library, S10) than MLX's matmul in mlx-vlm: there within 1e-4 (6e-6 measured at
    logits of ~15), and the greedy tokens above are equal."""
    import mlx_vlm
    import numpy as np
    from mlx_vlm.utils import prepare_inputs

    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.vision import load_vision

    path, image = vlm_paths[family], picture(3)
    tok = Tokenizer(path)
    vision = load_vision(path, tok)
    try:
        ids, spans = vision.render([ask(image)])
        holder = vision.image_token_id
    finally:
        vision.close()
    engine = MLXEngine(path, EngineSettings(rows=1, prefix_cache_bytes=0))
    ours = engine.prefill(0, ids, list(spans))
    model, processor = mlx_vlm.load(str(path))
    text = tok.render_chat([_template_turn()])
    inputs = dict(prepare_inputs(processor, images=[image.image], prompts=[text]))
    input_ids, pixels = inputs.pop("input_ids"), inputs.pop("pixel_values")
    assert np.array(input_ids).reshape(-1).tolist() == ids and holder in ids
    mask = inputs.pop("attention_mask")
    rows = model.get_input_embeddings(input_ids, pixels, mask=mask, **inputs).inputs_embeds
    theirs = np.array(model.language_model(input_ids, inputs_embeds=rows).logits[0, -1])
    if engine.fused is not None and engine.kernels.linux_cpu:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4)
    else:
        np.testing.assert_array_equal(ours, theirs.astype(np.float32))


def _template_turn(image: bool = True) -> dict:
    parts = [{"type": "image"}] if image else []
    return {
        "role": "user",
        "content": [*parts, {"type": "text", "text": "What is in the picture?"}],
    }


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_turn_two_with_the_same_image_is_cached_and_a_changed_image_misses(
    family, vlm_paths, make_service, monkeypatch
):
    svc = make_service(vlm_paths[family], 1)
    a, b = picture(4), picture(5)
    first, _ = answer(svc, chat([ask(a)]))
    reply = {"role": "assistant", "content": svc.tokenizer.decode(first)}

    def turn2(image):
        return [ask(image), reply, ask(None, "And the colours?")]

    _, spans = svc.vision.render(turn2(a))
    towers = []  # the images that go through the tower from here on
    tower = svc.vision.model.get_input_embeddings
    monkeypatch.setattr(
        svc.vision.model, "get_input_embeddings", lambda *a, **k: towers.append(1) or tower(*a, **k)
    )
    again, finish = answer(svc, chat(turn2(a)))
    assert finish.cached_tokens >= spans[-1].end  # every image position came from the cache
    assert towers == []  # and the tower did not run again
    _, changed = answer(svc, chat(turn2(b)))
    assert towers == [1]  # a new image: its tower runs once
    assert changed.cached_tokens <= spans[0].start  # the placeholders alone do not match
    cold = make_service(vlm_paths[family], 1, prefix_cache_bytes=0)
    assert answer(cold, chat(turn2(a)))[0] == again  # the cached turn answers as a cold one
