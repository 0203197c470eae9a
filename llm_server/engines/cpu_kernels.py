"""The engine's names for the Linux-CPU set's mlx-lm patches and streams (their code lives in
llm_server/native: mlx_lm_patches.py, cpu_kernels.py), and the output head of a model outside
the fused forward. The engine chooses the set and calls these only under it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from llm_server.engines import score_reduce
from llm_server.engines.layout import output_head
from llm_server.native import mlx_lm_patches
from llm_server.native.cpu_kernels import SPLIT_MAX_ROWS, release_streams  # noqa: F401
from llm_server.native.mlx_lm_patches import _INSTALLED, install, split_linears  # noqa: F401


def log_softmax(logits: mx.array) -> np.ndarray:
    """log-softmax over the last axis as a float32 numpy array (scoring reductions)."""
    return score_reduce.log_softmax(np.array(logits.astype(mx.float32)))


def lm_head(model, hidden: mx.array, split: bool) -> mx.array:
    """The model's output projection; `split` (the linux_cpu set): across streams for a 1-2
    row decode step."""
    layer, tied = output_head(model)
    return mlx_lm_patches.lm_head(layer, tied, hidden, split)
