"""The program each rank runs in test_stage_families: the same engine calls on a pipeline
stage of each tiny family; rank 0 then repeats them on one whole engine and prints, per family,
the largest logit difference (one JSON line)."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import numpy as np

from llm_server.engines.plan import DecodeRow, PrefillChunk, StepPlan

PROMPTS = [(5, 6, 7), (8, 9, 10, 11, 12, 13), (14, 15, 16, 17, 18, 19, 20, 21, 22, 23)]


def calls(engine) -> list[np.ndarray]:
    """Mixed steps (three fresh rows, then their decode beside a fresh row reusing a running
    row's prefix), a release, and a scoring chunk: every logits array, in order."""
    chunks = tuple(PrefillChunk(i, i, p, 0, len(p)) for i, p in enumerate(PROMPTS))
    first = engine.run(StepPlan(prefill=chunks))
    out = [first.logits]
    toks = [int(t) for t in first.logits.argmax(-1)]
    again = PrefillChunk(3, 3, (*PROMPTS[2][:8], 30, 31), 0, 10)  # shares 8 ids with row 2
    decode = tuple(DecodeRow(r, t) for r, t in zip(first.rows, toks, strict=True))
    second = engine.run(StepPlan(decode=decode, prefill=(again,)))
    out.append(second.logits)
    engine.release(0)
    engine.score_begin(2)
    scored = engine.score_chunk(np.array([[3, 4, 5, 6], [7, 8, 9, 10]]), np.ones((2, 4), int), 2)
    engine.score_end()
    out.append(np.asarray(scored.token_logprobs))
    return out


def main(paths: list[str]) -> None:
    import mlx.core as mx

    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    group = mx.distributed.init(strict=True, backend="ring")
    for path in paths:
        settings = EngineSettings(rows=4, prefix_cache_bytes=1 << 26)
        stage = MLXEngine(path, replace(settings, group=group, parallel="pipeline"))
        got = calls(stage)
        if group.rank() == 0:
            want = calls(MLXEngine(path, settings))
            diff = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
            print(json.dumps({"model": path, "max_diff": diff}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
