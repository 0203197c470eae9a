"""Attention of decode positions with one arithmetic, whatever step they ride in (CPU).

A decode token's logits must not depend on the step that computed it: alone or batched, pure
decode (the compiled graph, compiled_step) or beside a prompt chunk (the eager packed forward,
fused_decode), or as a position of a speculative draft being verified (S10). Measured on the
CPU (MLX 0.32, BLIS), these keep attention bit-identical across all of those:

- mx.compile does not change rounding here (its CPU kernels are built with `-O3`, no FMA
  contraction), so the compiled graph and the same ops run eagerly agree bit for bit;
- the grouped products, [rows x heads per KV head x q, Dh] @ [Dh, span] per (row, KV head),
  give each query row the same result whatever the number of rows in the product, as long as
  it is at least 2 (BLIS takes another summation order, a matrix-vector kernel, for 1 row), so
  a lone query of a model without grouped heads is duplicated;
- reading a span of each row's store rounded up to SPAN positions: the masked positions
  (probability exactly 0) add exact zeros, so every span of whole SPAN blocks gives the same
  result, while a span of exactly the history length (MLX's own attention over `kv_len`
  positions) sums in another order (a store capped short of a whole block, at a context
  length that is not whole blocks, is padded with masked zeros);
- `mx.fast.scaled_dot_product_attention`'s CPU fallback (one product per query head) rounds
  differently from the grouped form, so decode positions never use it on the CPU.

So every decode position (q = 1 rows, and the positions of a draft being verified) runs
`attend` over `span(...)` positions of its row, eagerly or inside a compiled graph.
"""

from __future__ import annotations

import mlx.core as mx

from llm_server import mlx_ops

# the span of whole SPAN blocks this arithmetic reads, its mask (llm_server/mlx_ops.py: the
# generic set's compiled step reads the same span)
SPAN, span, mask = mlx_ops.SPAN, mlx_ops.span, mlx_ops.mask


@mx.compile
def _softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis as max, one fused exp(x - max) kernel, sum and divide. On the
    CPU MLX builds fused kernels at run time (for this CPU: native.jit), where its softmax op
    runs a baseline-x86 exp one element at a time: 14 -> 5 ns an element."""
    e = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


def read(view, width: int) -> tuple[mx.array, mx.array]:
    """The first `width` store positions of a row view's rows (after its update), as
    `RowView.update_and_fetch` selects them: [B, KV, width, Dh] keys and values, decoded
    from the store's KV format (`store.decode`) to the compute dtype."""
    store, plan, i = view.store, view.plan, view.layer
    keys, values = store.keys[i], store.values[i]
    if plan.all_rows:
        return store.decode(i, keys[:, :, :width], values[:, :, :width])
    if plan.contiguous:
        r0, r1 = plan.rows[0], plan.rows[0] + len(plan.rows)
        return store.decode(i, keys[r0:r1, :, :width], values[r0:r1, :, :width])
    rows = mx.array(plan.rows)
    return store.decode(i, keys[rows, :, :width], values[rows, :, :width])


def attend(
    queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float
) -> mx.array:
    """queries [B, H, q, Dh] over keys/values [B, KV, span, Dh] with mask [B, 1, q, span] bool
    -> [B, H, q, Dh]. The query heads of a KV head (and the q positions) are the rows of one
    product per (row, KV head); see `attend_grouped`."""
    b, nh, q, hd = queries.shape
    nkv = keys.shape[1]
    out = attend_grouped(queries.reshape(b, nkv, nh // nkv * q, hd), keys, values, mask, scale)
    return out.reshape(b, nh, q, hd)


def attend_grouped(
    grouped: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float
) -> mx.array:
    """`attend` on queries already grouped by KV head: grouped [B, KV, rep * q, Dh] (the rep
    query heads of a KV head, each with its q positions) -> [B, KV, rep * q, Dh]. A span of
    part of a block (the store's capacity at a context length that is not whole blocks) is
    padded with masked zeros to whole blocks."""
    b, nkv, rows, hd = grouped.shape
    q = mask.shape[2]
    extra = -keys.shape[2] % SPAN
    if extra:  # a store capped at a context length of part of a block: pad to whole blocks
        keys, values = (mx.pad(t, [(0, 0), (0, 0), (0, extra), (0, 0)]) for t in (keys, values))
        mask = mx.pad(mask, [(0, 0), (0, 0), (0, 0), (0, extra)], constant_values=False)
    lone = rows == 1
    if lone:  # a 1-row product takes BLIS's matrix-vector kernel: another summation order
        grouped = mx.concatenate([grouped, grouped], axis=2)
    scores = grouped @ keys.swapaxes(-1, -2)  # [B, KV, rep * q, span]
    width = scores.shape[-1]
    if q > 1:  # each query head's q positions take their own mask rows
        scores, mask = scores.reshape(b, nkv, -1, q, width), mask[:, :, None]
    scores = mx.where(mask, scores * scale, mx.array(-float("inf"), scores.dtype))
    probs = _softmax(scores).reshape(b, nkv, -1, width)  # (a view: no op when q = 1)
    out = probs @ values  # [B, KV, rep * q, Dh]
    return out[:, :, :1] if lone else out


def attend_ops(ops, layer, qkv: mx.array, keys: mx.array, values: mx.array, rows, pos, rotation, q):
    """A layer's decode attention as the decode ops' three primitives (llm_server.native.
    decode_ops): qkv [B * q, (H + 2 KV) * Dh] (the stacked product of B rows' q new positions,
    row b's at pos[b]..pos[b] + q - 1), keys/values the store's arrays [R, KV, cap, Dh], rows
    and pos int32 [B] -> (out [B * q, H * Dh], the store's keys and values with the rotated new
    keys and the new values written at those positions of store rows `rows`)."""
    geometry = (rows, pos, rotation.cos2, rotation.sin2, layer.heads, layer.kv_heads)
    geometry += (layer.head_dim, q)
    keys = ops.write_kv(keys, qkv, *geometry, True)
    values = ops.write_kv(values, qkv, *geometry, False)
    return ops.attend(qkv, keys, values, *geometry, layer.scale), keys, values
