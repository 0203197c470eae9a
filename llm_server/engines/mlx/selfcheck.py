"""A load-time check for architectures the test suite does not cover.

The engine drives mlx-lm's model classes through its own row views (row_cache.py,
row_state.py). The families in VERIFIED_FAMILIES are tested on every run
(tests/engines/test_families.py); any other architecture mlx-lm can load is checked once at load:
two rows at different cursors take one batched decode step, and their logits must equal mlx-lm's
own forward on its own caches. A model whose forward fails or differs is served one request at
a time on mlx-lm's caches instead (never a wrong answer, never a failing first request).
"""

from __future__ import annotations

import numpy as np

# mlx-lm model modules (mistral loads as llama) covered by tests/engines/test_families.py
VERIFIED_FAMILIES = frozenset(
    {
        "llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "gpt_oss",
        "smollm3", "olmo2", "granite", "lfm2", "qwen3_next", "nemotron_h", "falcon_h1",
    }
)  # fmt: skip
_PROMPTS = ([3, 4, 5, 6, 7], [8, 9, 10])
_NEXT = (11, 12)


def row_forward_problem(engine) -> str | None:
    """None when the engine's rows give mlx-lm's logits; else what went wrong, in words.

    Leaves the rows in use (and the prefix cache) behind: the caller resets them.
    """
    import mlx.core as mx

    from llm_server.engines.mlx.layout import make_cache

    rows = min(engine.rows, 2)
    prompts = [[t % engine.vocab_size for t in p] for p in _PROMPTS[:rows]]
    nxt = [t % engine.vocab_size for t in _NEXT[:rows]]
    try:
        for r, p in enumerate(prompts):
            engine.prefill(r, p)
        got = engine.decode(list(range(rows)), nxt)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not batch this model
        return f"its forward over per-row caches fails ({type(exc).__name__}: {exc})"
    for r, p in enumerate(prompts):
        cache = make_cache(engine.model)
        ref = engine.model(mx.array([p + [nxt[r]]]), cache=cache)[0, -1].astype(mx.float32)
        ref = np.array(ref)
        tol = (1e-3 if engine.dtype == "float32" else 3e-2) * max(1.0, float(np.abs(ref).max()))
        if not np.abs(got[r] - ref).max() <= tol:
            return "its forward over per-row caches differs from mlx-lm's own"
    return None
