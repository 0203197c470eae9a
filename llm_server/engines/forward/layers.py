"""The fused forward's layers: stacked projections (q/k/v into one weight, gate/up into
another, each module's own weight rebound as a view of the stack), the per-layer record, a
group of packed positions, which mlx-lm layers can be fused, and the rotary cos/sin table with
the rotation that uses it.

Every output of a stacked product is the same dot product as in the separate products, and
the table holds exactly the values the layers' rope module computes (`rope_table` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

_KNOWN_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj", "rope", "q_norm", "k_norm"}
_KNOWN_MLP = {"gate_proj", "up_proj", "down_proj"}


@dataclass(frozen=True)
class Rotation:
    """Rotary embedding by a cos/sin table as x * cos2 + swap(x) * sin2, swap(x) = [x2 | x1]:
    one roll and one fused kernel per tensor (the half-split form takes two slices, two kernels
    and a concatenation). swap copies values, so this is the half-split form's arithmetic:
    x1 * cos + x2 * -sin, x2 * cos + x1 * sin. The native decode ops rotate the same way."""

    cos2: mx.array  # [positions, Dh] = [cos | cos]
    sin2: mx.array  # [positions, Dh] = [-sin | sin]

    @classmethod
    def of(cls, table: mx.array | None) -> Rotation | None:
        if table is None:
            return None
        half = table.shape[-1] // 2
        cos, sin = table[:, :half], table[:, half:]
        out = cls(mx.concatenate([cos, cos], -1), mx.concatenate([-sin, sin], -1))
        mx.eval(out.cos2, out.sin2)
        return out

    @staticmethod
    def swap(x: mx.array) -> mx.array:
        """x [..., Dh] -> [x2 | x1], its halves exchanged."""
        return mx.roll(x, x.shape[-1] // 2, axis=-1)

    def at(self, starts: list[int], q: int) -> tuple[mx.array, mx.array]:
        """cos2 and sin2 of positions starts[b] + 0..q-1, [B, 1, q, Dh] each."""
        pos = mx.array(starts)[:, None] + mx.arange(q)[None, :]  # [B, q]
        return self.cos2[pos][:, None], self.sin2[pos][:, None]


def rotate_eager(x: mx.array, cos2: mx.array, sin2: mx.array) -> mx.array:
    """x [..., Dh] rotated by cos2/sin2 broadcastable to it (Rotation)."""
    return x * cos2 + Rotation.swap(x) * sin2


@mx.compile
def _mix(x: mx.array, swapped: mx.array, cos2: mx.array, sin2: mx.array) -> mx.array:
    return x * cos2 + swapped * sin2


def rotate(x: mx.array, cos2: mx.array, sin2: mx.array) -> mx.array:
    """`rotate_eager` as one compiled kernel (decode shapes are few: one per row count)."""
    return _mix(x, Rotation.swap(x), cos2, sin2)


@dataclass
class Linear:
    """A stacked product's weight and bias, with the views the kernel sets read."""

    weight: mx.array  # [out, in]
    bias: mx.array | None
    # weight.T and its two column halves, as views made once: a step then adds no slice or
    # transpose ops of its own (a few hundred fewer graph ops per step)
    wt: mx.array = field(init=False)
    halves: tuple[mx.array, mx.array] = field(init=False)

    def __post_init__(self) -> None:
        half = self.weight.shape[0] // 2
        self.wt = self.weight.T
        self.halves = (self.weight[:half].T, self.weight[half:].T)
        mx.eval(self.wt, *self.halves)  # strided views of the same buffer, no copies


@dataclass
class Layer:
    qkv: Linear  # [(H + 2 KV) * Dh, dim]
    o: Linear
    gate_up: Linear  # [2 * inter, dim]
    down: Linear
    norm_in: nn.RMSNorm
    norm_post: nn.RMSNorm
    rope: nn.Module  # used where there is no cos/sin table
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    inter: int


@dataclass
class Group:
    """One group of a packed forward (FusedForward.run): `rows` rows of `q` new positions
    each, packed row by row."""

    ids: mx.array  # [rows, q] token ids
    # (layer, index, qkv [rows * q, (H + 2 KV) * Dh]) -> [rows * q, H * Dh], writing the new
    # keys and values into the group's store; `.whole_layer` (layer, index, x) -> x' where a
    # decode layer can run as one native call, else None
    attention: object
    exact: bool  # decode positions: the arithmetic of a pure decode step (S10)
    every: bool  # logits at every position (drafts, scoring), else at each row's last
    # (offset, rows [n, dim]): input embeddings that take the place of the token embeddings
    # at the group's packed positions offset .. offset + n - 1 (engines/plan.py: EmbeddingSpan)
    inputs: tuple[tuple[int, mx.array], ...] = ()

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def q(self) -> int:
        return self.ids.shape[1]

    @property
    def size(self) -> int:
        return self.ids.shape[0] * self.ids.shape[1]


def bias_of(m: nn.Linear) -> mx.array | None:
    return m.bias if "bias" in m else None


def stack(modules: list[nn.Linear]) -> Linear:
    """One weight (and bias) for `modules`; each module's weight becomes a view of it."""
    biases = [bias_of(m) for m in modules]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("some of the stacked projections have a bias and some do not")
    weight = mx.concatenate([m.weight for m in modules])
    bias = None if biases[0] is None else mx.concatenate(biases)
    mx.eval(weight, *([] if bias is None else [bias]))
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = weight[start : start + n]
        if bias is not None:
            m.bias = bias[start : start + n]
        mx.eval(m.parameters())  # views: the separate weights are freed here
        start += n
    return Linear(weight, bias)


def fusable(layer) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or getattr(layer, "use_sliding", False):
        return False
    if set(attn.children()) - _KNOWN_ATTN or set(mlp.children()) - _KNOWN_MLP:
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return all(isinstance(m, nn.Linear) for m in linears) and all(
        isinstance(n, nn.RMSNorm) for n in norms
    )


def rope_table(rope: nn.Module, head_dim: int, positions: int, dtype) -> mx.array | None:
    """[positions, head_dim] = [cos | sin] as `rope` computes them, or None if it is not a
    plain half-split rotation of all head_dim features.

    RoPE is linear in x: with x = [1...1, 0...0] it returns [cos | sin] at each position.
    """
    if getattr(rope, "traditional", True) or getattr(rope, "dims", None) != head_dim:
        return None
    half = head_dim // 2
    probe = mx.concatenate([mx.ones((positions, half)), mx.zeros((positions, half))], axis=-1)
    table = rope(probe.reshape(1, 1, positions, head_dim).astype(dtype))[0, 0]
    mx.eval(table)
    return table if table_matches(table, rope) else None


def table_matches(table: mx.array, rope: nn.Module) -> bool:
    """Whether rotating by `table` reproduces `rope` (random inputs, a few positions)."""
    positions, head_dim = table.shape
    rotation = Rotation.of(table)
    x = mx.random.normal((1, 1, 1, head_dim), key=mx.random.key(0)).astype(table.dtype)
    for pos in sorted({0, 1, positions // 2, positions - 1}):
        cos2, sin2 = rotation.cos2[pos], rotation.sin2[pos]
        if not mx.allclose(rotate(x, cos2, sin2), rope(x, offset=pos), rtol=1e-5, atol=1e-6).item():
            return False
    return True
