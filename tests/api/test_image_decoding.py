"""The server's image decoder (api/shared/images.py): PNG, JPEG, WebP and GIF's first frame as
RGB, a digest of the pixels, decompression bombs refused from their header, files sent again
not decoded again."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from llm_server.api.shared.errors import APIError
from llm_server.settings import ImageLimits
from tests.api.image_files import bomb_png, gif, png


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_format_decodes_to_rgb(fmt):
    from llm_server.api.shared.images import decode_image

    out = io.BytesIO()
    Image.new("RGB", (9, 6), (40, 80, 120)).save(out, fmt)
    image = decode_image(out.getvalue(), "f", ImageLimits())
    assert image.image.mode == "RGB" and image.image.size == (9, 6)
    r, g, b = image.image.getpixel((4, 3))
    assert abs(r - 40) < 12 and abs(g - 80) < 12 and abs(b - 120) < 12  # JPEG and GIF round


def test_gif_first_frame_and_transparency_on_white():
    from llm_server.api.shared.images import decode_image

    assert decode_image(gif(), "f", ImageLimits()).image.getpixel((0, 0)) == (255, 0, 0)
    out = io.BytesIO()
    Image.new("RGBA", (2, 2), (0, 0, 0, 0)).save(out, "PNG")
    assert decode_image(out.getvalue(), "f", ImageLimits()).image.getpixel((0, 0)) == (
        255,
        255,
        255,
    )


def test_digest_is_the_pixels():
    from llm_server.api.shared.images import decode_image

    limits = ImageLimits()
    same = Image.new("RGB", (5, 5), (1, 2, 3))
    as_png, as_webp = io.BytesIO(), io.BytesIO()
    same.save(as_png, "PNG")
    same.save(as_webp, "WEBP", lossless=True)
    a = decode_image(as_png.getvalue(), "f", limits).digest
    assert a == decode_image(png((5, 5), (1, 2, 3)), "g", limits).digest  # same pixels
    assert a == decode_image(as_webp.getvalue(), "f", limits).digest  # another format
    assert a != decode_image(png((5, 5), (1, 2, 4)), "f", limits).digest  # one channel differs
    assert a != decode_image(png((5, 4), (1, 2, 3)), "f", limits).digest  # another size
    assert len(a) == 64


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch):
    from PIL import ImageFile

    from llm_server.api.shared.images import decode_image

    def never(self):
        raise AssertionError("a bomb must not be decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    for size, limits in (
        ((100_000, 100_000), ImageLimits()),
        ((300, 300), ImageLimits(max_pixels=50_000)),
    ):
        with pytest.raises(APIError) as err:
            decode_image(bomb_png(*size), "f", limits)
        assert err.value.param == "f" and "--max-image-pixels" in err.value.message
    assert "300x300 = 90,000 pixels" in err.value.message


def test_a_file_sent_again_is_not_decoded_again(monkeypatch):
    """Agents resend every image on every turn: the same bytes are decoded once (the limits
    and the declared type are still checked); the cache is bounded by decoded bytes."""
    from llm_server.api.shared import images
    from llm_server.api.shared.image_cache import DecodedImages

    monkeypatch.setattr(images, "DECODED", DecodedImages(max_bytes=100 * 100 * 3))
    shot = png((100, 100), (9, 9, 9))
    first = images.decode_image(shot, "turn1", ImageLimits())
    calls = []
    monkeypatch.setattr(images, "_decode", lambda *a: calls.append(a))
    again = images.decode_image(shot, "turn2", ImageLimits())
    assert calls == [] and again.field == "turn2" and again.digest == first.digest
    with pytest.raises(APIError, match="--max-image-pixels"):
        images.decode_image(shot, "f", ImageLimits(max_pixels=100))
    with pytest.raises(APIError, match="media type says image/gif") as err:
        images.decode_image(shot, "f", ImageLimits(), "image/gif", "f.media_type")
    assert err.value.param == "f.media_type"
    monkeypatch.undo()
    cache = DecodedImages(max_bytes=100 * 100 * 3)
    decoded = images._decode(shot, "f", ImageLimits())
    cache.put(b"a", decoded)
    cache.put(b"b", decoded)  # over the bound: the least recently used goes
    assert cache.get(b"a") is None and cache.get(b"b") is decoded and cache.bytes == decoded.nbytes
