"""A chat request with images -> prompt ids with the processor's placeholder positions, and
each image's rows from the checkpoint's vision tower and projector as embedding spans.

The chat template renders the parts in the user's order (each image as `{"type": "image"}`, the
one form every family's template knows); mlx-vlm's processor expands each image's marker into
its placeholder positions (their number is the processor's, never the config's); mlx-vlm's
`get_input_embeddings` runs the tower and projector and scales the rows as its own generation
does; the rows at the placeholder positions become `EmbeddingSpan`s keyed by the image's
digest, so the prefix cache reuses a resent image and misses a different one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from llm_server.engines.plan import EmbeddingSpan
from llm_server.images import ImageInput, images_of
from llm_server.tokenizer import Tokenizer
from llm_server.vision.messages import image_runs, span_key, template_messages
from llm_server.vision.thread import VisionThread

CACHED_IMAGES = 32  # images whose tower rows are kept (a resent image skips the tower)


class ImageRejected(Exception):
    """The model's processor could not read one image: the image is at fault (a 400 naming
    `field`, the request field it came from)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class TowerFailed(Exception):
    """The vision tower or projector failed on one image the processor had read: the server
    is at fault (a 500 for that request alone; `field` names the image)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class VisionRenderer:
    """A vision-language checkpoint's tower, projector and processor (mlx-vlm), and its chat
    template (the service's tokenizer).

    One thread of its own owns the mlx-vlm model (`VisionThread`; MLX arrays belong to the
    thread whose stream made them, as the engine's belong to the scheduler thread): `render`
    may be called from any thread and waits for that one; the rows leave it as numpy arrays."""

    def __init__(self, path: Path, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._thread = VisionThread()
        try:
            self._thread.call(self._load, path)
        except BaseException:
            self._thread.stop()
            raise

    def _load(self, path: Path) -> None:
        from mlx_vlm.utils import load_model, load_processor, should_add_special_tokens

        tokenizer = self.tokenizer
        # lazy: the language model's layers are the engine's and are never read here
        self.model = load_model(path, lazy=True)
        _drop_token_table(self.model)
        # every processor file is the folder's: a missing one is an error, never a hub request
        self.processor = load_processor(path, add_detokenizer=False, local_files_only=True)
        self.model_type = str(self.model.config.model_type)
        config = self.model.config
        self.image_token_id = int(getattr(config, "image_token_index", None) or 0)
        if not self.image_token_id:
            self.image_token_id = int(config.image_token_id)
        self.add_special_tokens = should_add_special_tokens(self.model_type, self.processor)
        self.one_image = tokenizer.render_chat([{"role": "user", "content": [{"type": "image"}]}])
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()  # digest -> [n, hidden]
        self.encode_seconds = 0.0  # the tower and projector's time since start (/metrics)
        self.images_encoded = 0  # images through the tower (a resent one is not counted)

    def close(self) -> None:
        self._thread.stop()

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> tuple[list[int], tuple[EmbeddingSpan, ...]]:
        """Prompt ids (placeholders at the image positions) and one span per contiguous run of
        an image's positions. ChatTemplateError when the template rejects the messages;
        ImageRejected when the processor cannot read an image, TowerFailed when the tower fails
        on one; ValueError when the processor's positions do not match the images. A failure
        is that request's alone: the thread goes on serving the next."""
        return self._thread.call(self._render, messages, tools, template_kwargs)

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, template_kwargs: dict | None
    ) -> tuple[list[int], tuple[EmbeddingSpan, ...]]:
        text = self.tokenizer.render_chat(template_messages(messages), tools, template_kwargs)
        images = images_of(messages)
        for image in images:
            _pixels(image)  # a string here is the server's bug (TypeError), not the image's
        try:
            ids = self._prompt_ids(text, images)
        except Exception as exc:
            raise self._culprit(images) or exc from None
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        rows = [self.image_rows(image) for image in images]
        if sum(len(r) for r in rows) != len(positions):
            raise ValueError(
                f"the processor placed {len(positions)} image positions for {len(images)} "
                f"image(s) whose tower gave {sum(len(r) for r in rows)} rows"
            )
        spans, at = [], 0
        for image, image_rows in zip(images, rows, strict=True):
            own = positions[at : at + len(image_rows)]
            at += len(image_rows)
            for run, (a, b) in enumerate(image_runs(own)):
                spans.append(EmbeddingSpan(own[a], image_rows[a:b], span_key(image.digest, run)))
        return ids, tuple(spans)

    def _prompt_ids(self, text: str, images: list[ImageInput]) -> list[int]:
        """The processor's ids of `text` with each image marker expanded to its positions."""
        inputs = self._inputs(text, images)
        return [int(t) for t in np.array(inputs["input_ids"]).reshape(-1)]

    def _culprit(self, images: list[ImageInput]) -> ImageRejected | None:
        """After the processor failed on a prompt's images: the first image it cannot read
        alone (None: each reads alone, the prompt as a whole is at fault)."""
        for image in images:
            try:
                self._image_inputs(image)
            except Exception as exc:  # noqa: BLE001 - any processor error is the image's
                return _rejected(image, exc)
        return None

    def _inputs(self, text: str, images: list[ImageInput]) -> dict[str, Any]:
        from mlx_vlm.utils import prepare_inputs

        return prepare_inputs(
            self.processor,
            images=[_pixels(image) for image in images] or None,
            prompts=[text],
            image_token_index=self.image_token_id,
            add_special_tokens=self.add_special_tokens,
        )

    def image_rows(self, image: ImageInput) -> np.ndarray:
        """The rows the tower and projector give `image` at its placeholder positions,
        [n, hidden] float32, as mlx-vlm's generation puts them in the prompt (on the vision
        thread; kept by digest, so a resent image skips the tower)."""
        if image.digest in self._rows:
            self._rows.move_to_end(image.digest)
            return self._rows[image.digest]
        _pixels(image)
        started = time.perf_counter()
        try:
            inputs = self._image_inputs(image)
        except Exception as exc:
            raise _rejected(image, exc) from exc
        try:
            rows = self._encode(image, inputs)
        except Exception as exc:
            raise TowerFailed(
                image.field,
                f"the vision tower failed on the image at {image.field} "
                f"({type(exc).__name__}: {str(exc)[:200]})",
            ) from exc
        self.encode_seconds += time.perf_counter() - started
        self.images_encoded += 1
        self._rows[image.digest] = rows
        while len(self._rows) > CACHED_IMAGES:
            self._rows.popitem(last=False)
        return rows

    def _image_inputs(self, image: ImageInput) -> dict[str, Any]:
        """The processor's inputs for `image` alone in one user turn (its pixel values)."""
        return dict(self._inputs(self.one_image, [image]))

    def _encode(self, image: ImageInput, inputs: dict[str, Any]) -> np.ndarray:
        """The tower and projector's rows at the image's placeholder positions of `inputs`."""
        import mlx.core as mx

        input_ids = inputs.pop("input_ids")
        pixel_values = inputs.pop("pixel_values")
        mask = inputs.pop("attention_mask", None)
        out = self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **inputs)
        embeds = out.inputs_embeds[0].astype(mx.float32)
        where = np.flatnonzero(np.array(input_ids).reshape(-1) == self.image_token_id)
        return np.array(embeds[mx.array(where)])


def _rejected(image: ImageInput, exc: Exception) -> ImageRejected:
    return ImageRejected(
        image.field,
        f"the model's image processor cannot read the image at {image.field} "
        f"({type(exc).__name__}: {str(exc)[:200]}); send a plain RGB PNG or JPEG",
    )


def _drop_token_table(model) -> None:
    """Stand zeros in for the language model's token embedding: `get_input_embeddings` looks
    up every prompt position, but only the image rows are read here (the engine embeds the
    text), and the table, the largest matrix of many VLMs, is then never loaded twice."""
    import mlx.nn as nn

    lm = model.language_model
    for owner in (lm, getattr(lm, "model", None)):
        if isinstance(owner, nn.Module) and "embed_tokens" in owner:
            table = owner["embed_tokens"]
            dtype = getattr(table, "scales", table.weight).dtype
            owner["embed_tokens"] = _NoTokenRows(int(model.config.text_config.hidden_size), dtype)
            return


class _NoTokenRows:
    """Rows of zeros [*ids.shape, hidden] for any token ids."""

    def __init__(self, hidden: int, dtype) -> None:
        self.hidden, self.dtype = hidden, dtype

    def __call__(self, ids):
        import mlx.core as mx

        return mx.zeros((*ids.shape, self.hidden), self.dtype)


def _pixels(image: ImageInput):
    """The decoded picture (never a URL or a path: mlx-vlm would fetch or open those)."""
    from PIL import Image

    if not isinstance(image.image, Image.Image):
        raise TypeError(f"{image.field}: an image must be decoded pixels, not {type(image.image)}")
    return image.image
