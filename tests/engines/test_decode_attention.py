"""Decode attention (llm_server/native/decode_attention.py): one arithmetic for a decode
position whatever span is read, whatever rows ride beside it and whether it is a lone query or
a position of a draft being verified (ARCHITECTURE S10)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from llm_server.native import decode_attention as da
from llm_server.native.decode_attention import SPAN


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3)])
def test_decode_attention_is_the_same_for_any_span_batch_and_query_length(heads, kv_heads):
    """A position's attention does not depend on the span read (whole SPAN blocks), the other
    rows of the step, or whether it is one query or a position of a draft being verified;
    without grouped heads too (a lone query is duplicated: BLIS's 1-row kernel rounds
    differently)."""
    rng = np.random.default_rng(5)
    q, hd, scale = 3, 128, 128**-0.5  # a scale that is not a power of two
    queries = mx.array(rng.standard_normal((2, heads, q, hd)).astype(np.float32))
    keys, values = (
        mx.array(rng.standard_normal((2, kv_heads, 16 * SPAN, hd)).astype(np.float32))
        for _ in range(2)
    )
    starts = mx.array([5 * SPAN + 7, 9 * SPAN - 2], dtype=mx.int32)  # rows at own cursors
    width = da.span(9 * SPAN + 1, 16 * SPAN)
    ref = np.array(
        da.attend(
            queries, keys[:, :, :width], values[:, :, :width], da.mask(starts, q, width), scale
        )
    )
    for span in (width, width + SPAN, 16 * SPAN, 9 * SPAN + 5, 16 * SPAN - 3):  # ragged too
        for b in range(2):
            for i in range(q):
                alone = da.attend(
                    queries[b : b + 1, :, i : i + 1],
                    keys[b : b + 1, :, :span],
                    values[b : b + 1, :, :span],
                    da.mask(starts[b : b + 1] + i, 1, span),
                    scale,
                )
                np.testing.assert_array_equal(np.array(alone)[0, :, 0], ref[b, :, i])
    # a store of part of a block (capped at such a context length) reads like whole blocks
    short = mx.array([12, 9], dtype=mx.int32)
    want = da.attend(
        queries[:, :, :1], keys[:, :, :SPAN], values[:, :, :SPAN], da.mask(short, 1, SPAN), scale
    )
    for span in (13, 20, SPAN + 1):
        got = da.attend(
            queries[:, :, :1],
            keys[:, :, :span],
            values[:, :, :span],
            da.mask(short, 1, span),
            scale,
        )
        np.testing.assert_array_equal(np.array(got), np.array(want))
