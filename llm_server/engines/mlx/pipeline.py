"""Pipeline parallel: rank r holds a contiguous slice of the decoder layers and their KV.

mlx-lm 0.32 gives `pipeline()` to a few model classes only (not llama or qwen3), so the plain
decoder stacks (embedding, layers, norm) get it here: the stack's forward is swapped for one
where rank r > 0 receives the hidden states [B, q, hidden] from rank r - 1 (`recv_like`), runs
its layers, sends them on to rank r + 1, and the last stage's output reaches every rank through
one `all_gather` (rank 0 samples from it; the others compute the head and drop it). Every rank
runs the same calls (rank 0's broadcast), so each send meets its recv; the groups of one step
are evaluated one at a time (mlx_forward.py) so the transfers pair in the same order everywhere.
The embedding, the norm and the head are small next to the layers and kept on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# model modules whose decoder stack is embed -> layers(h, mask, cache) -> norm, with one mask
# for every layer (no sliding-window layers): the families the tests cover
PIPELINE_FAMILIES = frozenset({"llama", "qwen2", "qwen3"})


def stage_layers(layers: int, ranks: int) -> list[range]:
    """Each rank's layers: contiguous, in rank order, the low ranks get the extra ones."""
    if layers < ranks:
        raise ValueError(f"{layers} layers do not split over {ranks} pipeline ranks")
    base, extra = divmod(layers, ranks)
    out, start = [], 0
    for r in range(ranks):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class PipelineStack:
    """Mixed into the model's own stack class: the forward of one pipeline stage."""

    pipeline_group = None
    stage_rank = 0
    stage_count = 1

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
        from mlx_lm.models.base import create_attention_mask

        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        rank, size, group = self.stage_rank, self.stage_count, self.pipeline_group
        if rank > 0:  # the hidden states of the layers before ours
            h = mx.distributed.recv_like(h, rank - 1, group=group)
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask, c)
        if rank < size - 1:
            h = mx.distributed.send(h, rank + 1, group=group)
        # the last stage's output on every rank; rank 0's copy depends on its send, so the
        # gather is ordered after it in every rank's graph
        b = h.shape[0]
        h = mx.distributed.all_gather(h, group=group)[(size - 1) * b : size * b]
        return self.norm(h)


def refusal(model) -> str | None:
    """Why `model` cannot be served pipeline-parallel here (None: it can)."""
    from llm_server.engines.mlx.layout import inner_name, model_family

    family = model_family(model)
    if family not in PIPELINE_FAMILIES:
        return (
            f"--pipeline serves {', '.join(sorted(PIPELINE_FAMILIES))} models, not {family} "
            "(shard it tensor-parallel: leave out --pipeline)"
        )
    inner = getattr(model, inner_name(model) or "", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return f"{family}: no embed -> layers -> norm decoder stack to split"
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        return f"{family}: sliding-window layers are not split over pipeline ranks"
    return None


@dataclass(frozen=True)
class Stage:
    """The layers one pipeline rank holds."""

    layers: range  # in the model's numbering
    total: int  # layers of the whole model


def split_model(model, group) -> Stage:
    """Keep this rank's layers of `model` (still lazy: the others are never loaded) and give
    its stack the stage forward."""
    from llm_server.engines.mlx.layout import inner_name

    problem = refusal(model)
    if problem is not None:
        raise ValueError(problem)
    inner = getattr(model, inner_name(model))
    total = len(inner.layers)
    kept = stage_layers(total, group.size())[group.rank()]
    inner.layers = inner.layers[kept.start : kept.stop]
    base = type(inner)
    inner.__class__ = type(f"Pipeline{base.__name__}", (PipelineStack, base), {})
    inner.pipeline_group = group
    inner.stage_rank = group.rank()
    inner.stage_count = group.size()
    if hasattr(inner, "start_idx"):  # mlx-lm's PipelineMixin (qwen2): its slice is ours now
        inner.start_idx, inner.end_idx = 0, None
    return Stage(kept, total)
